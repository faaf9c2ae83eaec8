"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` and ``LLM.chat``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedserve.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                               StructuredOutputsConfig)
from pagedserve.engine import LLMEngine
from pagedserve.outputs import RequestOutput
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
    """

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | str | None = None,
        memory_utilization: float | None = None,
        gpu_memory_utilization: float | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        seed: int = 0,
        threads: int | None = None,
        scheduling_policy: str = "fcfs",
        scheduler_delay_factor: float = 0.0,
        num_gpu_blocks_override: int | None = None,
        chat_template: str | None = None,
        quantization: str | None = None,
        kv_offload_memory: int | str | None = None,
        preemption_mode: str = "auto",
        cpu_offload_gb: float = 0.0,
        device_map: str | Sequence[str | tuple[str, int | None]] | None = None,
        cpu_bind: str | None = None,
        structured_outputs_config: dict | StructuredOutputsConfig | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        if memory_utilization is not None and gpu_memory_utilization is not None \
                and memory_utilization != gpu_memory_utilization:
            raise ValueError("memory_utilization and gpu_memory_utilization (its alias) disagree")
        util = memory_utilization if memory_utilization is not None else gpu_memory_utilization
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              chat_template=chat_template, quantization=quantization),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              memory_utilization=util,
                              enable_prefix_caching=enable_prefix_caching,
                              num_gpu_blocks_override=num_gpu_blocks_override,
                              kv_offload_memory=kv_offload_memory, preemption_mode=preemption_mode,
                              cpu_offload_gb=cpu_offload_gb),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill, policy=scheduling_policy,
                                      delay_factor=scheduler_delay_factor),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend),
            device=DeviceConfig(device=device, threads=threads, device_map=device_map, cpu_bind=cpu_bind),
            structured_outputs=_structured_config(structured_outputs_config, reasoning_parser),
        )
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

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        A prompt is a string, a list of token ids, or {"prompt": str} /
        {"prompt_token_ids": [...]}.  A bad prompt or parameter raises ValueError
        before anything is queued.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        # Validate everything first so one bad prompt does not leave others queued.
        normalized = [engine.validate_prompt(*self._split(p)) for p in prompts]
        ids = []
        for i, ((text, tokens), sp) in enumerate(zip(normalized, params)):
            rid = str(next(self._counter))
            engine.add_request(rid, text, sp, prompt_token_ids=tokens,
                               priority=priority[i] if priority else 0)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    @staticmethod
    def _split(prompt: Prompt) -> tuple[str | None, list[int] | None]:
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
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the model's chat template and generate replies.

        tools: OpenAI-style tool definitions shown to the template (`tools=`);
        chat_template_kwargs: further template variables (e.g. `enable_thinking`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        template = chat_template or self.llm_engine.config.model.chat_template
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           chat_template=template, **(chat_template_kwargs or {}),
                                           **({"tools": tools} if tools else {}))
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _structured_config(value: dict | StructuredOutputsConfig | None, reasoning_parser: str | None) -> StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config`` (a dict or the dataclass) plus ``reasoning_parser``."""
    if isinstance(value, StructuredOutputsConfig):
        fields = {"backend": value.backend, "reasoning_parser": value.reasoning_parser}
    elif isinstance(value, dict):
        fields = dict(value)
    elif value is None:
        fields = {}
    else:
        raise ValueError(f"structured_outputs_config must be a dict or StructuredOutputsConfig, got {value!r}")
    if reasoning_parser is not None:
        fields["reasoning_parser"] = reasoning_parser
    return StructuredOutputsConfig(**fields)
