"""The offline API: ``LLM(...).generate(prompts, sampling_params)``, ``LLM.chat``, ``LLM.embed``,
``LLM.classify`` and ``LLM.score``."""

from __future__ import annotations

import argparse
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from pagedserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine
from pagedserve.engine.request_options import continue_final_message as cut_after_final_message
from pagedserve.entrypoints.engine_args import engine_config_from_args, engine_config_from_kwargs, engine_signature
from pagedserve.entrypoints.scoring import (
    ScoringOutput,
    ScoringRequestOutput,
    answer_logprob,
    answer_params,
    answer_token_ids,
    check_score_labels,
    pair_texts,
    pair_token_ids,
    relevance,
    rerank_prompt,
)
from pagedserve.lora import LoRARequest
from pagedserve.lora.request import per_prompt_lora
from pagedserve.multimodal.chat import chat_media, has_image_parts
from pagedserve.multimodal.processor import media_limits
from pagedserve.outputs import RequestOutput
from pagedserve.pooling import EmbeddingRequestOutput, PoolingParams, classifier_labels
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM"]

Prompt = str | list[int] | dict


class LLM:
    """An engine plus a batch loop.  Argument names follow vLLM's ``LLM``.

    model: None (the default model), a Hugging Face checkpoint folder or a .gguf file.
    kv_offload_memory, preemption_mode, cpu_offload_gb: the memory hierarchy (host KV
    tier, swap preemption, weight offload), see docs/memory.md.
    device_map: decoder layers split across platforms, e.g. "cuda:20,cpu" (the first 20
    layers on cuda, the rest on cpu) or "cpu:0-14,cuda:15-29"; see docs/memory.md.
    Every engine setting is a keyword argument (docs/engine_settings.md).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # Every other keyword is an engine setting (pagedserve.entrypoints.engine_args):
        # a TypeError names the closest one for a misspelling.
        self._start(engine_config_from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM running ``config``."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> LLM:
        """An LLM from a command's flags (``add_engine_arguments``) and its positional
        ``model``; ``overrides`` (setting name -> value) win."""
        return cls.from_engine_config(engine_config_from_args(args, **{"model": args.model, **overrides}))

    def _start(self, config: EngineConfig) -> None:
        if config.device.device_map is not None:
            # Unknown or unavailable platforms anywhere in the map: one ValueError listing
            # the available ones, before anything loads.
            from pagedserve.offload.device_map import check_device_map_platforms

            check_device_map_platforms(config.device.device_map)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor/pipeline parallel); idempotent."""
        self.llm_engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache until :meth:`wake_up` (needs
        ``enable_sleep_mode=True``): level 1 keeps a host-memory copy of the weights, level 2
        reads the checkpoint again on waking.  ``generate`` and the others raise
        EngineSleepingError meanwhile.  See docs/memory.md#sleep-mode."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reload the weights and allocate an empty KV cache.  ``tags`` (vLLM's partial
        wake-up, e.g. ["weights"]) is not implemented: everything wakes at once."""
        if tags is not None:
            raise ValueError(f"wake_up(tags={tags!r}) is not implemented: call wake_up() to wake weights and KV cache")
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's name)."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        ``lora_request``: one adapter for every prompt, or one per prompt (None: the
        base model); needs ``enable_lora=True`` (docs/lora.md).

        A prompt is a string, a list of token ids, or {"prompt": str} /
        {"prompt_token_ids": [...]}.  A bad prompt or parameter raises ValueError
        before anything is queued.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        images = [self.multi_modal_data(p) for p in prompts]
        # Validate everything first so one bad prompt does not leave others queued (a
        # prompt with images is checked when queued: its processor expands it).
        normalized = [
            (self.split_prompt(p)[0], None)
            if mm
            else engine.validate_prompt(*self.split_prompt(p), sp.truncate_prompt_tokens)
            for p, sp, mm in zip(prompts, params, images)
        ]
        loras = per_prompt_lora(lora_request, len(prompts))
        for lora in dict.fromkeys(x for x in loras if x is not None):
            engine.check_lora_request(lora)
        ids = []
        try:
            for i, ((text, tokens), sp) in enumerate(zip(normalized, params)):
                rid = str(next(self._counter))
                engine.add_request(
                    rid,
                    text,
                    sp,
                    prompt_token_ids=tokens,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                    multi_modal_data=images[i],
                )
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)  # a bad prompt with images: nothing stays queued
            raise
        return self._run(ids, use_tqdm)

    @staticmethod
    def multi_modal_data(prompt: Prompt) -> dict | None:
        """A dict prompt's ``multi_modal_data`` (``{"image": image or [images]}``), else None."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown:
                raise ValueError(f"prompt dict has unsupported keys {sorted(unknown)}")
            return prompt.get("multi_modal_data") or None
        return None

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, use_tqdm: bool = False
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``out.outputs.embedding``), in prompt order: the final
        hidden states pooled as the engine's ``pooling`` says (see pagedserve.pooling)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.llm_engine
        params = pooling_params or PoolingParams()
        normalized = [engine.validate_prompt(*self.split_prompt(p)) for p in prompts]
        ids = []
        for text, tokens in normalized:
            rid = str(next(self._counter))
            engine.add_request(rid, text, prompt_token_ids=tokens, pooling_params=params)
            ids.append(rid)
        outputs = self._run(ids, use_tqdm)
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise RuntimeError(f"embedding request {failed[0].request_id} failed: {failed[0].error}")
        return outputs  # type: ignore[return-value]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """The score head's output per prompt (``out.outputs.probs``, ``.logits``,
        ``.num_classes``) of a sequence-classification checkpoint, in prompt order
        (pagedserve.pooling); ValueError for a model without one."""
        if classifier_labels(self.llm_engine.arch) is None:
            raise ValueError("classify needs a sequence-classification checkpoint (a score.weight head)")
        return self.embed(prompts, PoolingParams(task="classify"), use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        instruction: str | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each ``data_2`` text to its ``data_1`` query, in [0, 1]
        (``out.outputs.score``): one query for every text, or one per text.  The model
        judges the pair in Qwen3-Reranker's format and the score is P(yes) against P(no)
        (pagedserve.entrypoints.scoring); ValueError unless "yes" and "no" are single
        tokens of its vocabulary.  A sequence-classification checkpoint instead scores the
        tokenizer's pair encoding with its one-label head (``instruction`` must be None)."""
        engine = self.llm_engine
        pairs = pair_texts(
            data_1 if isinstance(data_1, str) else list(data_1),
            data_2 if isinstance(data_2, str) else list(data_2),
            ("data_1", "data_2"),
        )
        labels = classifier_labels(engine.arch)
        if labels is not None:
            check_score_labels(labels)
            if instruction is not None:
                raise ValueError("instruction applies to yes/no rerankers, not to a sequence-classification head")
            outs = self.classify([pair_token_ids(engine.tokenizer, q, d) for q, d in pairs], use_tqdm)
            return [
                ScoringRequestOutput(str(i), ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                for i, o in enumerate(outs)
            ]
        yes, no = answer_token_ids(engine.tokenizer)
        prompts = []
        for query, text in pairs:
            prompt = rerank_prompt(query, text, instruction)
            prompts.append(
                {"prompt": prompt, "prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)}
            )
        both = [p for p in prompts for _ in (yes, no)]
        outs = self.generate(both, [answer_params(t) for _ in prompts for t in (yes, no)], use_tqdm=use_tqdm)
        return [
            ScoringRequestOutput(
                str(i),
                ScoringOutput(relevance(answer_logprob(outs[2 * i], yes), answer_logprob(outs[2 * i + 1], no))),
                outs[2 * i].prompt_token_ids,
            )
            for i in range(len(prompts))
        ]

    @staticmethod
    def split_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None]:
        """(text, token ids) of a prompt in any form ``generate`` takes; either may be None."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], None
        if isinstance(prompt, str):
            return prompt, None
        return None, list(prompt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
                if not engine.has_unfinished_requests() and pending:
                    raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
            engine.flush_kv_transfers()  # a KV connector's saves of the last step's blocks
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search over the engine (see pagedserve.beam_search): the best
        ``params.beam_width`` sequences of each prompt, best first."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.llm_engine
        ids = [engine.validate_prompt(*self.split_prompt(p))[1] for p in prompts]
        search = BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len)

        def expand(tokens: list[list[int]], step: SamplingParams) -> list:
            outs = self.generate([{"prompt_token_ids": t} for t in tokens], step, use_tqdm=False)
            return [o.outputs[0].logprobs[0] for o in outs]

        search.run(expand)
        return search.outputs(lambda t: engine.tokenizer.decode(t))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the model's chat template and generate replies.

        tools: OpenAI-style tool definitions shown to the template (`tools=`);
        continue_final_message (with add_generation_prompt=False): the last, assistant,
        message is left open for the model to continue; chat_template_kwargs: extra
        template variables."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        template = chat_template or self.llm_engine.config.model.chat_template
        limits = media_limits(self.llm_engine.config)
        mm = self.llm_engine.input_processor.mm_processor
        prompts = []
        for conv in conversations:
            images: list = []
            videos: list = []
            if has_image_parts([m.get("content") for m in conv if isinstance(m, dict)]):
                placeholders = (mm.placeholder, mm.video_placeholder) if mm is not None else (None, None)
                conv, images, videos = chat_media(conv, limits, *placeholders)
            text = tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **{**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})},
            )
            if continue_final_message:
                text = cut_after_final_message(text, conv)
            if images or videos:
                data = {"image": images, **({"video": videos} if videos else {})}
                prompts.append({"prompt": text, "multi_modal_data": data})
            else:
                prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


# help(LLM) and IDEs list every engine setting with its default.
LLM.__init__.__signature__ = engine_signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
)
