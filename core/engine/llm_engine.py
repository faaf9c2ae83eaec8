"""LLMEngine: composition of platform, model, scheduler and executor, request intake and
the synchronous step.

engine = LLMEngine(EngineConfig(...))
engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...

Intake is `InputProcessor`, outputs are `OutputProcessor` (or, with async_scheduling,
`AsyncPipeline` around it); features that take part in the step (speculative decoding,
the step trace) are `StepHook` objects, so `step()` has no branch per feature.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from pagedserve.config import EngineConfig, images_per_prompt
from pagedserve.config_rules import (
    check_kv_cache_groups,
    check_multimodal,
    check_parallel_fits_model,
    check_sliding_window_cache,
    resolve_block_size,
)
from pagedserve.engine.async_pipeline import AsyncPipeline
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.kv_handoff import KVHandoff
from pagedserve.engine.output_processor import OutputProcessor, OutputStage, RequestState
from pagedserve.engine.stats import EngineStats, StepCounters
from pagedserve.engine.step_hooks import SpecDecodeHook, StepHook, TraceHook
from pagedserve.engine.step_trace import StepTrace
from pagedserve.executor.executor import create_executor
from pagedserve.executor.model_runner import check_cache_dtype, check_kv_scales, resolve_dtype
from pagedserve.kv_cache.sliding_window import uniform_window
from pagedserve.loader import open_model
from pagedserve.loader.generation_config import load_generation_defaults
from pagedserve.loader.tokenizer_source import engine_tokenizer
from pagedserve.loader.validation import effective_max_model_len
from pagedserve.lora import LoRAManager, LoRARequest
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import layer_windows
from pagedserve.models.registry import resolve_vision_class
from pagedserve.multimodal.processor import build_mm_processor
from pagedserve.offload import build_kv_manager, offload_weights
from pagedserve.offload.connectors import check_kv_connector, is_device_layout_connector
from pagedserve.offload.device_map import device_map_platform_classes
from pagedserve.outputs import RequestOutput
from pagedserve.platforms import select_platform
from pagedserve.pooling import PoolingParams, load_score_head, resolve_pooling
from pagedserve.quantization.registry import quantize_source
from pagedserve.request import RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.spec_decode.builder import build_spec_decoder, check_draft_model, target_quantization
from pagedserve.structured_output.engine_hooks import build_structured_output_manager

__all__ = ["LLMEngine", "EngineSleepingError"]

logger = logging.getLogger(__name__)


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (``LLMEngine.sleep``)."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()  # every cross-feature rule, before any model or worker work
        torch.manual_seed(config.model.seed)
        self.platform, self.ops = select_platform(config.device.device)
        self.platform.configure_threads(config.device.threads, config.device.bind_cores)
        source = open_model(config.model.model)
        self.model_source = source
        self.arch = ArchConfig.from_hf(source.hf_config)
        check_parallel_fits_model(config, self.arch)
        check_multimodal(config, self.arch.multimodal)  # images with what they cannot combine with yet
        if self.arch.multimodal and images_per_prompt(config.model) > 0:
            # The vision side's own needs of the engine (Gemma 3: an image in one step).
            vision_cls = resolve_vision_class(self.arch.multimodal["architecture"])
            if vision_cls is not None and hasattr(vision_cls, "check_engine"):
                vision_cls.check_engine(config, self.arch, self.ops, source.path)
        # The window by which the KV manager frees slid-out blocks (None: keeps them all).
        windows = layer_windows(self.arch.hf_config, self.arch.num_layers)
        # The KV block size (the user's, else the platform's), before anything sizes the cache.
        self.config = config = self._resolve_block_size(config, windows)
        tier = config.cache.kv_connector is not None and is_device_layout_connector(config.cache.kv_connector)
        kv_window = check_sliding_window_cache(config, uniform_window(windows), tier)
        check_kv_cache_groups(config, windows, tier)  # layers with different windows: one table per group
        self.tokenizer = engine_tokenizer(config.model, source, self.arch.vocab_size)
        self.eos_token_ids = frozenset(source.eos_token_ids)
        #: SamplingParams defaults from generation_config.json (see loader/generation_config.py).
        self.default_sampling_params = load_generation_defaults(config.model.generation_config, source.path)
        mml = effective_max_model_len(config.model.max_model_len, self.arch.max_position_embeddings, self.arch.head_dim)
        self.max_model_len = mml
        #: How embedding requests pool (pagedserve.pooling): setting, checkpoint, else last.
        self.pooling = resolve_pooling(config.model.pooling, source.path)
        #: A sequence-classification checkpoint's score head (pagedserve.pooling), else None.
        self.score_head = load_score_head(source, self.arch.num_labels, self.arch.hidden_size)
        draft_source = check_draft_model(config, self.arch, mml)  # before any weights load
        self.dtype = resolve_dtype(config.model.dtype, self.platform)
        check_cache_dtype(config.cache.cache_dtype, self.dtype, [self.platform])
        check_kv_scales(config.cache, self.arch.architecture)  # latent attention: unscaled rows only
        check_kv_connector(config)  # a plugin's: a store by content or a device-layout tier (interface 1.7)
        # Linear weights load quantized when config.model.quantization or the checkpoint asks.
        source = self.model_source = quantize_source(
            source,
            target_quantization(config),
            self.platform,
            self.ops,
            self.dtype,
            config.parallel.world_size,
            config.cache.cpu_offload_gb,
            config.device.device_map,
        )
        # One rank in this process, or several (tensor/pipeline parallel) behind one executor.
        self.executor = create_executor(config, self.platform, self.ops, self.arch, self.dtype, source, mml)
        self.runner = self.executor.driver_runner  # rank 0's runner: it owns the sampler
        # A plain manager, or one with a host KV tier (kv_offload_memory).
        self.kv = build_kv_manager(config, self.executor.num_blocks, self.runner, kv_window, mml, windows)
        self.weight_streamer = offload_weights(config, self.runner)  # cpu_offload_gb
        # Grammars compile on its worker thread; the step plans each one's bitmask (sample_step.py).
        self.structured = build_structured_output_manager(config, self.tokenizer, self.arch, self.eos_token_ids)
        self.spec = build_spec_decoder(config, self.executor, draft_source, mml, self.dtype)
        self.lora = LoRAManager.attach(config.lora, self.runner)  # enable_lora (docs/lora.md)
        max_loras = config.lora.max_loras if self.lora is not None else None
        long_prefill = self.platform.default_long_prefill_token_threshold
        # A vision-language model's per-step encoder budget: a step's worth of image tokens.
        encoder_budget = config.scheduler.max_num_batched_tokens if self.runner.vision is not None else 0
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            mml,
            long_prefill,
            max_loras=max_loras,
            encoder_budget=encoder_budget,
            whole_image_spans=bool(getattr(self.runner.vision, "bidirectional_images", False)),
        )
        self.counters = StepCounters()
        self.output_processor = OutputProcessor(self._release, self.counters)
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            self.arch.vocab_size,
            self.arch.hidden_size,
            self.eos_token_ids,
            mml,
            self.pooling,
            self.structured,
            self.lora,
            self.kv.enable_prefix_caching,
            self.output_processor.groups,
            self.score_head,
            build_mm_processor(config, source.path, self.runner),
        )
        #: async_scheduling: output processing beside the next forward (async_pipeline.py).
        self._outputs: OutputStage = (
            AsyncPipeline(self.output_processor) if config.scheduler.async_scheduling else self.output_processor
        )
        #: PAGEDSERVE_STEP_TRACE: one JSON line per step (step_trace.py); None when off.
        self.step_trace = StepTrace.from_env(config.scheduler.async_scheduling)
        self.hooks = _step_hooks(self.step_trace, config.scheduler.async_scheduling, self.spec)
        # The hooks' forwards nested around the executor's, the first hook outermost.
        wrap = lambda inner, hook: functools.partial(hook.forward, inner=inner)  # noqa: E731
        self._forward = functools.reduce(wrap, reversed(self.hooks), self._execute)
        #: Disaggregated prefill/decode: a prompt's cached KV blocks out of and into this engine.
        self._handoff = KVHandoff(self.kv, self.runner)
        #: Sleep mode: the level the engine sleeps at, None while awake.
        self.sleep_level: int | None = None

    def _resolve_block_size(self, config: EngineConfig, windows: list) -> EngineConfig:
        """``config`` with its block size resolved (config_rules.resolve_block_size): the
        platforms of a device map each have a default."""
        defaults = [self.platform.default_block_size]
        if config.device.device_map is not None:
            defaults += [cls.default_block_size for cls in device_map_platform_classes(config.device.device_map)]
        config, how = resolve_block_size(config, defaults, windows)
        logger.info("KV cache blocks of %d tokens (%s)", config.cache.block_size, how)
        return config

    # -- sleep mode --------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache (enable_sleep_mode, docs/memory.md): level 1
        keeps a host-memory copy of the weights to wake from, level 2 reads the checkpoint
        again on waking.  Every rank sleeps.  The prefix cache is emptied (its blocks go
        with the KV cache).  ValueError while requests are in flight; sleeping again does
        nothing.  Requests are refused (EngineSleepingError) until :meth:`wake_up`."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep needs the engine started with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(
                f"sleep level must be 1 (weights kept in host memory) or 2 (weights reloaded from the "
                f"checkpoint), got {level!r}"
            )
        if self.is_sleeping:
            return
        busy = self.get_num_unfinished_requests()
        if busy:
            raise ValueError(
                f"cannot sleep with {busy} request(s) in flight: wait for them to finish or abort them first"
            )
        # Copies recorded but not run yet (host tier, KV connector saves) read the device cache.
        pending = self.kv.flush_transfers()
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use with no request in flight")
        self.executor.sleep(level, pending)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Reload the weights and allocate an empty KV cache; nothing when awake."""
        if not self.is_sleeping:
            return
        self.executor.wake_up()
        self.sleep_level = None

    def check_awake(self) -> None:
        """EngineSleepingError while the engine sleeps."""
        if self.sleep_level is not None:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level}): wake it with wake_up() "
                "(POST /wake_up) before sending requests"
            )

    # -- disaggregated prefill/decode (kv_handoff.py) ----------------------------------------
    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None) -> torch.Tensor:
        self.check_awake()
        return self._handoff.export_prefix_kv(token_ids, cache_salt)

    def import_prefix_kv(self, token_ids: list[int], kv: torch.Tensor, cache_salt: str | None = None) -> int:
        self.check_awake()
        return self._handoff.import_prefix_kv(token_ids, kv, cache_salt)

    def empty_prefix_kv(self, num_blocks: int) -> torch.Tensor:
        return self._handoff.empty_prefix_kv(num_blocks)

    # -- requests ---------------------------------------------------------------------------
    def validate_prompt(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None, truncate_prompt_tokens=None
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt (see `InputProcessor.validate_prompt`)."""
        return self.input_processor.validate_prompt(prompt, prompt_token_ids, truncate_prompt_tokens)

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """Load ``lora_request``'s adapter into host memory (ValueError when it cannot serve)."""
        self.input_processor.check_lora_request(lora_request)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) on bad input.
        ``multi_modal_data``: ``{"image": image or [images]}`` (docs/multimodal.md).

        With ``pooling_params`` it is an embedding request (``params`` is ignored)."""
        self.check_awake()
        intake = self.input_processor
        if pooling_params is not None and multi_modal_data:
            raise ValueError("embedding requests with images are not supported yet")
        if pooling_params is not None:
            args = (prompt, pooling_params, prompt_token_ids, arrival_time, priority, cache_salt)
            group = intake.process_pooling(request_id, *args)
        else:
            args = (prompt, params, prompt_token_ids, arrival_time, priority, cache_salt, lora_request)
            group = intake.process(request_id, *args, multi_modal_data=multi_modal_data)
        for seq in group.seqs:
            self.scheduler.add_request(seq.request)
        self.output_processor.add(group)

    def abort_request(self, request_id: str | list[str]) -> None:
        self.output_processor.abort([request_id] if isinstance(request_id, str) else list(request_id))

    def _release(self, request_id: str, status: RequestStatus) -> None:
        """Free what the scheduler, the sampler and the hooks hold for one sample."""
        self.scheduler.finish_request(request_id, status)
        self.runner.sampler.forget(request_id)
        self.runner.forget(request_id)
        for hook in self.hooks:
            hook.forget(request_id)

    @property
    def groups(self) -> dict[str, RequestState]:
        """The requests in flight by id (the output processor's)."""
        return self.output_processor.groups

    def request_ids(self) -> list[str]:
        return list(self.output_processor.groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.groups)

    def running_request_ids(self) -> list[str]:
        """Ids of requests with a sample in the running set: those a failed step may have
        left half-updated, so a caller that survives the failure aborts them."""
        return self.output_processor.running_request_ids({r.request_id for r in self.scheduler.running})

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, detokenize; outputs of requests that advanced
        (with async_scheduling, of the step before: see async_pipeline.py)."""
        start = time.monotonic()
        for hook in self.hooks:
            hook.before_schedule(self.scheduler)
        sched = self.scheduler.schedule()
        if sched.empty:
            self.flush_kv_transfers()
            return self._outputs.flush()
        # Copies: a request a stop string finishes beside the forward gives its list back.
        block_ids = {s.request.request_id: list(self.kv.block_ids(s.request.request_id)) for s in sched.scheduled}
        result = self._outputs.overlap(lambda: self._forward(sched, block_ids))
        self.counters.count_step(sched)
        progressed = self.scheduler.update_after_step(sched, result.sampled, result.accepted)
        self.counters.count_generated(len(progressed))
        self.output_processor.account(progressed, result.prompt_logprobs)
        outputs = self._outputs.process(sched, result, progressed, self.runner.take_row_errors())
        for hook in reversed(self.hooks):
            hook.after_step(self.scheduler, len(outputs))
        self.scheduler.record_step_latency(time.monotonic() - start)
        return outputs

    def flush_kv_transfers(self) -> None:
        """Run the block copies still pending once every forward has run (a KV
        connector's saves of the last step's blocks); for when no step is scheduled."""
        pending = self.kv.flush_transfers()
        if pending:
            self.runner.run_kv_transfers(pending)

    def _execute(self, sched, block_ids: dict) -> object:
        return self.executor.execute(sched, block_ids)

    def shutdown(self) -> None:
        """Stop worker processes or actors (a no-op for a single-process engine)."""
        try:  # a KV connector's last saves and its index; never in the way of stopping
            if not self.is_sleeping and not self.has_unfinished_requests():
                self.flush_kv_transfers()
            self.kv.close()
        except Exception:  # noqa: BLE001 - logged; the workers must still stop
            logger.exception("saving the KV connector's blocks at shutdown failed")
        self.executor.shutdown()
        self.structured.shutdown()
        self._outputs.shutdown()

    def stats(self) -> EngineStats:
        extra: dict[str, object] = {}
        for hook in self.hooks:
            extra.update(hook.counters())
        return self.counters.snapshot(self.scheduler, self.kv, extra)


def _step_hooks(trace: StepTrace | None, async_scheduling: bool, spec) -> list[StepHook]:
    """The step's hooks, outermost first: the trace times the whole step."""
    hooks: list[StepHook] = []
    if trace is not None and not async_scheduling:  # async steps return the previous outputs
        hooks.append(TraceHook(trace))
    if spec is not None:
        hooks.append(SpecDecodeHook(spec))
    return hooks
