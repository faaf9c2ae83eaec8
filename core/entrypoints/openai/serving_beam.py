"""``use_beam_search`` on the HTTP API: the beam search of pagedserve.beam_search driven
through the AsyncLLMEngine.  ``n`` is the beam width (as in vLLM); the sampling fields
beam search does not use are refused rather than ignored."""

from __future__ import annotations

from typing import Any

from pagedserve.beam_search import BeamSearch, BeamSearchParams
from pagedserve.engine.client import EngineClient
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_temperature, used
from pagedserve.sampling_params import SamplingParams

__all__ = ["check_beam_fields", "run_beam_search", "beam_params", "beam_choices"]

# Fields that change sampling but that beam search does not use.
_NOT_WITH_BEAMS = (
    "stream",
    "best_of",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
    "echo",
    "logprobs",
    "top_logprobs",
    "include_stop_str_in_output",
    "suffix",
)


def check_beam_fields(request: Any, is_chat: bool) -> None:
    """400 for length_penalty without beam search, or a field beam search would ignore."""
    table = CHAT_FIELDS if is_chat else COMPLETION_FIELDS
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise ApiError(400, "'length_penalty' only applies with 'use_beam_search': true.", param="length_penalty")
        return
    for name in _NOT_WITH_BEAMS:
        if name in table and used(getattr(request, name, None), table[name].default):
            raise ApiError(400, f"'{name}' cannot be combined with 'use_beam_search'.", param=name)


def beam_params(request: Any, max_tokens: int, defaults: dict) -> BeamSearchParams:
    check_temperature(request)
    temperature = request.temperature if request.temperature is not None else defaults.get("temperature", 1.0)
    try:
        return BeamSearchParams(
            beam_width=request.n,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=temperature,
            length_penalty=request.length_penalty,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = {"beam_width": "n"}.get(name, name)
        raise ApiError(400, str(e).replace("beam_width", "n (the beam width)"), param=param) from None


async def run_beam_search(
    serving: Any, request_id: str, prompts: list[list[int]], params: BeamSearchParams, priority: int = 0
) -> list:
    """The BeamSearchOutput of every prompt; each step's beams go to the engine together."""
    engine = serving.engine
    search = BeamSearch(prompts, params, _eos_ids(engine), engine.max_model_len)
    step_no = 0

    async def expand(tokens: list[list[int]], step: SamplingParams) -> list:
        nonlocal step_no
        step_no += 1
        prompts_ = [(None, t) for t in tokens]
        streams = await serving.submit(f"{request_id}-s{step_no}", prompts_, [step] * len(tokens), "prompt", priority)
        finals = await serving.collect(streams)
        return [f.outputs[0].logprobs[0] for f in finals]

    await search.run_async(expand)
    return search.outputs(lambda t: serving.tokenizer.decode(t))


def _eos_ids(engine: EngineClient) -> frozenset[int]:
    ids = engine.eos_token_ids
    if ids is None:
        raise ApiError(400, "'use_beam_search' is not available with data parallelism.", param="use_beam_search")
    return ids


def beam_choices(outputs: list, prompt_lens: list[int], chat: bool) -> tuple[list[dict], int]:
    """(choices, completion tokens) of a beam-search response: prompt i's beam j is
    choice i * n + j, best beam first."""
    choices, generated = [], 0
    for i, out in enumerate(outputs):
        n = len(out.sequences)
        for j, seq in enumerate(out.sequences):
            generated += len(seq.tokens) - prompt_lens[i]
            body = {"message": {"role": "assistant", "content": seq.text}} if chat else {"text": seq.text}
            choices.append(
                {"index": i * n + j, **body, "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
            )
    return choices, generated


async def beam_search_response(
    serving: Any,
    request: Any,
    request_id: str,
    model: str,
    prompts: list[tuple[str | None, list[int]]],
    params: list[SamplingParams],
    chat: bool,
) -> dict:
    """The whole response of a use_beam_search request (streaming is refused)."""
    bp = beam_params(request, min(p.max_tokens for p in params), serving.generation_defaults)
    ids = [p for _, p in prompts]
    outputs = await run_beam_search(serving, request_id, ids, bp, request.priority)
    choices, generated = beam_choices(outputs, [len(p) for p in ids], chat)
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": serving.created(),
        "model": model,
        "choices": choices,
        "usage": serving.usage(sum(len(p) for p in ids), generated),
    }
