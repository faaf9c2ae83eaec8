"""Request models of the OpenAI-compatible API and their conversion to SamplingParams.

Bodies are validated strictly (no "3" for an integer, no `true` for a number), and every
problem becomes an `ApiError` whose `param` names the offending field.  A field of
vLLM's API that is not implemented here is refused with a 400 (request_fields.py);
other unknown fields are ignored, as vLLM does, so newer clients keep working.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_temperature,
    refuse_unimplemented,
)
from pagedserve.entrypoints.openai.serving_beam import check_beam_fields
from pagedserve.entrypoints.openai.structured import structured_outputs_of
from pagedserve.entrypoints.openai.tools import message_tool_fields
from pagedserve.sampling_params import SamplingParams

__all__ = [
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "parse_request",
    "normalize_prompts",
    "chat_messages",
    "to_sampling_params",
]

_M = TypeVar("_M", bound=BaseModel)

MAX_N = 128  # more samples than this per prompt is a mistake, not a workload


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    # Extra fields are kept so that vLLM fields not implemented here can be refused.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    echo: bool = False
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None  # completions: True, chat: False (vLLM's defaults)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None
    # Output constraints (pagedserve.entrypoints.openai.structured checks them)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by normalize_prompts
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list of {"type": "text", "text": str}, checked by chat_messages
    name: str | None = None
    tool_calls: Any = None  # assistant turns; checked by tools.message_tool_fields
    tool_call_id: str | None = None  # tool turns


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


# Pydantic's location of an error inside a union names the member type ("list[str]");
# those parts are not field names and are left out of `param`.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|[a-z_-]+\[.*\])$")


def _param_of(loc: tuple) -> str | None:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif not _TYPE_TAG.match(p):
            parts.append(("." if parts else "") + p)
    return "".join(parts) or None


def parse_request(cls: type[_M], body: bytes) -> _M:
    """Validate a JSON body; ApiError(400) naming the first bad field."""
    try:
        return cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"The request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise ApiError(400, "The request body must be a JSON object") from None
        param = _param_of(err["loc"])
        if err["type"] == "missing":
            raise ApiError(400, f"Missing required parameter: '{param}'.", param=param) from None
        raise ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param) from None


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: strings or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt):
            return list(prompt)
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", param="prompt")
    raise ApiError(
        400,
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists, none of them empty.",
        param="prompt",
    )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them; text parts are joined like vLLM does."""
    if not messages:
        raise ApiError(400, "'messages' must contain at least one message.", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(400, f"'{where}': only text content parts are supported.", param=where)
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"'{where}.text' must be a string.", param=f"{where}.text")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None and m.role in ("assistant", "tool"):
            content = ""
        elif not isinstance(content, str):
            where = f"messages[{i}].content"
            raise ApiError(400, f"'{where}' must be a string or a list of text parts.", param=where)
        role = "system" if m.role == "developer" else m.role
        # A participant's name reaches the template, as in vLLM.
        out.append(
            message_tool_fields(
                m, {"role": role, "content": content, **({"name": m.name} if m.name is not None else {})}, i
            )
        )
    return out


def _unsupported(request: _GenerationRequest) -> None:
    is_completion = isinstance(request, CompletionRequest)
    refuse_unimplemented(request, COMPLETION_FIELDS if is_completion else CHAT_FIELDS)
    check_beam_fields(request, not is_completion)
    checks: list[tuple[str, bool]] = [
        ("best_of", bool(request.stream) and request.best_of not in (None, request.n)),
        ("prompt_logprobs", bool(request.stream) and request.prompt_logprobs is not None),
    ]
    if request.prompt_logprobs is not None and request.prompt_logprobs < 0:
        raise ApiError(
            400,
            "'prompt_logprobs' must be an integer in [0, 20] here (-1, full distributions, is offline-only).",
            param="prompt_logprobs",
        )
    for name, used in checks:
        if used:
            why = " with stream: true" if name in ("best_of", "prompt_logprobs") else " by this server"
            raise ApiError(400, f"'{name}' is not supported{why}.", param=name)


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams for one prompt; `max_tokens` is already checked against the context;
    `defaults` (generation_config.json) fill the sampling fields the request leaves unset."""
    d = defaults or {}
    _unsupported(request)
    if not 1 <= request.n <= MAX_N:
        raise ApiError(400, f"'n' must be between 1 and {MAX_N}, got {request.n}.", param="n")
    check_temperature(request)
    if request.best_of is not None and not request.n <= request.best_of <= MAX_N:
        raise ApiError(
            400, f"'best_of' must be between n ({request.n}) and {MAX_N}, got {request.best_of}.", param="best_of"
        )
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise ApiError(
                400, f"'top_logprobs' must be between 0 and 20, got {request.top_logprobs}.", param="top_logprobs"
            )
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        logprobs = request.logprobs
        logprobs_field = "logprobs"
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo and isinstance(request, CompletionRequest):
        prompt_logprobs = logprobs  # echoed prompt tokens carry logprobs too, as in vLLM
    fields = dict(
        n=request.n,
        temperature=d.get("temperature", 1.0) if request.temperature is None else request.temperature,
        top_p=d.get("top_p", 1.0) if request.top_p is None else request.top_p,
        top_k=d.get("top_k", 0) if request.top_k is None else request.top_k,
        min_p=d.get("min_p", 0.0) if request.min_p is None else request.min_p,
        seed=request.seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=(
            d.get("repetition_penalty", 1.0) if request.repetition_penalty is None else request.repetition_penalty
        ),
        logprobs=logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        logit_bias=request.logit_bias,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        prompt_logprobs=prompt_logprobs,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        best_of=request.best_of,
        structured_outputs=structured_outputs_of(request),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        # SamplingParams names the field first ("top_p must be in (0, 1], got 2.0").
        name = str(e).split(" ", 1)[0]
        param = logprobs_field if name == "logprobs" else (name if name in fields else None)
        raise ApiError(400, str(e), param=param) from None
