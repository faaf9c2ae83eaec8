"""LLMEngine: the synchronous step loop tying scheduler, executor and detokenizer together.

engine = LLMEngine(EngineConfig(...))
engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.config_rules import (
    check_kv_cache_groups,
    check_logprobs_limit,
    check_parallel_fits_model,
    check_prompt_fits_step,
    check_sliding_window_cache,
)
from pagedserve.engine_pipeline import StepPipeline
from pagedserve.executor.executor import create_executor
from pagedserve.executor.model_runner import check_cache_dtype, resolve_dtype
from pagedserve.kv_cache.host_tier import TieredKVCacheManager
from pagedserve.kv_cache.sliding_window import uniform_window
from pagedserve.loader import IncrementalDetokenizer, open_model
from pagedserve.loader.generation_config import load_generation_defaults
from pagedserve.loader.tokenizer_source import engine_tokenizer
from pagedserve.loader.validation import effective_max_model_len
from pagedserve.lora import LoRAManager, LoRARequest, lora_cache_salt
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import layer_windows
from pagedserve.offload import build_kv_manager, offload_weights
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.platforms import select_platform
from pagedserve.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, PoolingState, resolve_pooling
from pagedserve.quantization.registry import quantize_source
from pagedserve.request import Request, RequestStatus
from pagedserve.request_options import best_sequences, check_request_params, sample_params, truncate_prompt
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.spec_decode.builder import build_spec_decoder, check_draft_model, target_quantization
from pagedserve.step_trace import StepTrace
from pagedserve.step_trace import now as trace_now
from pagedserve.structured_output.engine_hooks import build_structured_output_manager, finish_by_grammar

__all__ = ["LLMEngine", "EngineStats", "ITERATION_TOKEN_BUCKETS"]

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """Engine-side state of one sample: its Request plus detokenization and logprobs."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None


@dataclass
class _Group:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    arrival_time: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why this request failed on its own
    params: SamplingParams | None = None
    #: prompt_logprobs: entry of prompt token p (p >= 1) by position.
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    #: An embedding request: its pooled states so far and its options.
    pool: PoolingState | None = None
    pooling_params: PoolingParams | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and (cumulative) counters.

    Token counts are in tokens, block counts in KV blocks.  The host-tier fields
    (docs/memory.md) stay zero without ``kv_offload_memory``.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of device blocks referenced by requests
    prefix_cache_queries: int
    prefix_cache_hits: int  # on device or on host
    num_preemptions: int  # by swap or by recompute
    prompt_tokens: int
    generation_tokens: int
    host_kv_cache_blocks: int = 0  # size of the host pool
    host_kv_cache_usage: float = 0.0  # fraction of host blocks referenced (swapped out, copies pending)
    host_kv_cache_cached_blocks: int = 0  # host blocks holding a prefix-cache block
    host_prefix_cache_hits: int = 0  # prompt tokens found on host (part of prefix_cache_hits)
    kv_blocks_spilled: int = 0  # evicted device blocks copied to host
    kv_spills_dropped: int = 0  # evictions not spilled: no host block was free
    kv_blocks_reloaded: int = 0  # host blocks copied back for prefix-cache hits
    num_swap_outs: int = 0  # preemptions by swap (requests)
    num_swap_ins: int = 0  # swapped-out requests resumed (requests)
    kv_blocks_swapped_out: int = 0  # blocks copied to host by swap-outs
    kv_blocks_swapped_in: int = 0  # blocks copied back by swap-ins
    #: Steps by tokens scheduled, cumulative per bucket of ITERATION_TOKEN_BUCKETS (the
    #: last count is the +Inf bucket), and the tokens of all steps together.
    iteration_tokens_buckets: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    spec_decode_num_drafts: int = 0  # verification steps of requests with drafts
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified
    spec_decode_num_accepted_tokens: int = 0  # draft tokens accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at draft position 0, 1, ...


#: Upper bounds of the steps-by-batched-tokens histogram (vLLM's iteration_tokens_total).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
        # The window by which the KV manager frees slid-out blocks (None: keeps them all).
        windows = layer_windows(self.arch.hf_config, self.arch.num_layers)
        kv_window = check_sliding_window_cache(config, uniform_window(windows))
        check_kv_cache_groups(config, windows)  # layers with different windows: one table per group
        self.tokenizer = engine_tokenizer(config.model, source, self.arch.vocab_size)
        self.eos_token_ids = frozenset(source.eos_token_ids)
        #: SamplingParams defaults from generation_config.json (see loader/generation_config.py).
        self.default_sampling_params = load_generation_defaults(config.model.generation_config, source.path)
        mml = effective_max_model_len(config.model.max_model_len, self.arch.max_position_embeddings, self.arch.head_dim)
        self.max_model_len = mml
        #: How embedding requests pool (pagedserve.pooling): setting, checkpoint, else last.
        self.pooling = resolve_pooling(config.model.pooling, source.path)
        draft_source = check_draft_model(config, self.arch, mml)  # before any weights load
        self.dtype = resolve_dtype(config.model.dtype, self.platform)
        check_cache_dtype(config.cache.cache_dtype, self.dtype)
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
        num_blocks = self.executor.num_blocks
        # A plain manager, or one with a host KV tier (kv_offload_memory).
        self.kv = build_kv_manager(config, num_blocks, self.runner, kv_window, mml, windows)
        self.weight_streamer = offload_weights(config, self.runner)  # cpu_offload_gb
        self.scheduler = Scheduler(config.scheduler, self.kv, mml, self.platform.default_long_prefill_token_threshold)
        # Grammars compile on its worker thread; the step plans each one's bitmask (sample_step.py).
        self.structured = build_structured_output_manager(config, self.tokenizer, self.arch, self.eos_token_ids)
        self.spec = build_spec_decoder(config, self.runner, draft_source, mml, self.dtype)
        self.lora = LoRAManager.attach(config.lora, self.runner)  # enable_lora (docs/lora.md)
        self.scheduler.max_loras = config.lora.max_loras if self.lora is not None else None
        self.groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._iteration_buckets = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        #: async_scheduling: output processing beside the next forward (engine_pipeline.py).
        self.pipeline = StepPipeline(self) if config.scheduler.async_scheduling else None
        #: PAGEDSERVE_STEP_TRACE: one JSON line per step (step_trace.py); None when off.
        self.step_trace = StepTrace.from_env(config.scheduler.async_scheduling)

    # -- requests ---------------------------------------------------------------------------
    def validate_prompt(
        self,
        prompt: str | list[int] | None,
        prompt_token_ids: list[int] | None,
        truncate_prompt_tokens: int | None = None,
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt, keeping only its last ``truncate_prompt_tokens``
        tokens when set; ValueError naming the problem and the limit."""
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids, prompt = list(prompt), None
            else:
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.arch.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        kept = truncate_prompt(list(prompt_token_ids), truncate_prompt_tokens)
        if len(kept) < len(prompt_token_ids):
            prompt_token_ids = kept
            prompt = None if prompt is None else self.tokenizer.decode(kept, skip_special_tokens=False)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        check_prompt_fits_step(self.config.scheduler, len(prompt_token_ids))
        return prompt, list(prompt_token_ids)

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
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) on bad input.

        With ``pooling_params`` it is an embedding request (``params`` is ignored)."""
        if pooling_params is not None:
            return self._add_pooling_request(
                request_id, prompt, pooling_params, prompt_token_ids, arrival_time, priority, cache_salt
            )
        params = params or SamplingParams()
        self.check_lora_request(lora_request)
        cache_salt = lora_cache_salt(cache_salt, lora_request)
        check_logprobs_limit(self.config.model, params)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt, ids = self.validate_prompt(prompt, prompt_token_ids, params.truncate_prompt_tokens)
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        check_request_params(params, self.arch.vocab_size, encode)
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(
                f"priority {priority} needs scheduling_policy='priority' (--scheduling-policy "
                f"priority); this engine schedules {self.config.scheduler.policy!r}"
            )
        compiled = self.structured.prepare(params.structured_outputs) if params.structured_outputs else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(
            request_id,
            prompt,
            ids,
            [],
            arrival,
            params=params,
            prompt_logprobs={} if params.prompt_logprobs is not None else None,
        )
        first: Request | None = None
        children = sample_params(params, encode)
        for i, child_params in enumerate(children):
            rid = request_id if len(children) == 1 else f"{i}_{request_id}"
            # A request scoring its prompt computes every prompt position itself.
            share = (
                self.kv.enable_prefix_caching and first is not None and first.sampling_params.prompt_logprobs is None
            )
            req = Request(
                rid,
                ids,
                child_params,
                self.eos_token_ids,
                arrival,
                priority,
                cache_salt,
                self.max_model_len,
                wait_for=first if share else None,
                lora_request=lora_request,
            )
            if compiled is not None:
                req.structured = self.structured.new_state(compiled)  # one matcher per sample
            first = first or req
            detok = IncrementalDetokenizer(self.tokenizer, ids, child_params.skip_special_tokens)
            seq = _Sequence(req, i, detok, logprobs=[] if child_params.logprobs is not None else None)
            group.seqs.append(seq)
        for seq in group.seqs:
            self.scheduler.add_request(seq.request)
            self._seq_of[seq.request.request_id] = (group, seq)
        self.groups[request_id] = group

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        pooling: PoolingParams,
        prompt_token_ids: list[int] | None,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        """An embedding request: the prompt is computed, pooled, and the request finishes."""
        if pooling.dimensions is not None and pooling.dimensions != self.arch.hidden_size:
            raise ValueError(
                f"dimensions={pooling.dimensions} is not supported: this model's embeddings have "
                f"{self.arch.hidden_size} dimensions (no truncation)"
            )
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority'")
        prompt, ids = self.validate_prompt(prompt, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = SamplingParams(max_tokens=1)
        req = Request(
            request_id,
            ids,
            params,
            self.eos_token_ids,
            arrival,
            priority,
            cache_salt,
            self.max_model_len,
            pooling=self.pooling,
        )
        seq = _Sequence(req, 0, IncrementalDetokenizer(self.tokenizer, ids, True))
        group = _Group(
            request_id,
            prompt,
            ids,
            [seq],
            arrival,
            params=params,
            pool=PoolingState(self.pooling),
            pooling_params=pooling,
        )
        self.scheduler.add_request(req)
        self._seq_of[request_id] = (group, seq)
        self.groups[request_id] = group

    def _finish_pooling(self, sched, pooled: dict) -> dict[str, _Group]:
        """Fold this step's pooled states in; finish (and free) requests whose prompt is done."""
        done: dict[str, _Group] = {}
        for s in sched.scheduled:
            r = s.request
            entry = self._seq_of.get(r.request_id) if r.pooling is not None else None
            if entry is None:
                continue
            group, seq = entry
            if r.request_id in pooled:
                group.pool.add(pooled[r.request_id])
            if r.num_computed_tokens >= r.num_prompt_tokens:
                self._release(seq, RequestStatus.FINISHED_STOPPED)
                group.metrics.setdefault("finished_time", time.monotonic())
                done[group.request_id] = group
        return done

    def _embedding_output(self, group: _Group) -> EmbeddingRequestOutput:
        out = EmbeddingRequestOutput(
            group.request_id,
            None,
            group.prompt_token_ids,
            group.prompt,
            group.finished,
            group.error,
            {**group.metrics, "arrival_time": group.arrival_time},
        )
        if group.error is None and group.seqs[0].finish_reason == "stop":  # its whole prompt was pooled
            try:
                out.outputs = EmbeddingOutput(group.pool.result(group.pooling_params.normalize))
            except RuntimeError as e:
                out.error = f"{type(e).__name__}: {e}"
        return out

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """Load ``lora_request``'s adapter into host memory (ValueError naming the file or
        field when it cannot serve this model); None is the base model."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} needs an engine with enable_lora=True (--enable-lora)"
            )
        self.lora.add_adapter(lora_request)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                self._release(seq, RequestStatus.FINISHED_ABORTED)

    def _release(self, seq: _Sequence, status: RequestStatus) -> None:
        rid = seq.request.request_id
        self.scheduler.finish_request(rid, status)
        self.runner.sampler.forget(rid)
        if self.spec is not None:
            self.spec.forget(rid)
        self._seq_of.pop(rid, None)
        if seq.finish_reason is None:
            seq.finish_reason = status.value

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def running_request_ids(self) -> list[str]:
        """Ids of requests with a sample in the running set: those a failed step may have
        left half-updated, so a caller that survives the failure aborts them."""
        running = {r.request_id for r in self.scheduler.running}
        return [gid for gid, g in self.groups.items() if any(s.request.request_id in running for s in g.seqs)]

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, detokenize; outputs of requests that advanced
        (with async_scheduling, of the step before: see engine_pipeline.py)."""
        if self.pipeline is not None:
            return self.pipeline.step()
        start, trace = time.monotonic(), self.step_trace
        t0 = trace_now() if trace is not None else 0.0
        if self.spec is not None:
            self.spec.hold_back(self.scheduler.running, self.scheduler.waiting)
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        if trace is not None:
            trace.begin(t0, sched)
        block_ids = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled}
        result = self.spec.execute(sched, block_ids) if self.spec is not None else None
        if result is None:
            result = self.executor.execute(sched, block_ids)
        if trace is not None:
            trace.forward_done()
        progressed = self._account_step(sched, result)
        touched = self._process_tokens(progressed, result.logprobs, result.accepted, result.accepted_logprobs)
        touched.update(self._finish_pooling(sched, result.pooled))
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        self.scheduler.last_step_latency = time.monotonic() - start
        outputs = []
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self.groups.pop(group.request_id, None)
        if trace is not None:
            trace.end(self.scheduler, len(outputs))
        return outputs

    def _count_iteration(self, num_tokens: int) -> None:
        """One step into the steps-by-batched-tokens histogram."""
        i = bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)
        self._iteration_buckets[i] += 1
        self._iteration_tokens_sum += num_tokens

    def _account_step(self, sched, result) -> list[Request]:
        """After a forward: the token counters, prompt logprobs and the scheduler's update;
        returns the requests that gained a token, their times stamped (before their
        tokens are processed: a finished request leaves _seq_of)."""
        self._count_iteration(sched.num_batched_tokens)
        for s in sched.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self.prompt_tokens += min(s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)
        self._store_prompt_logprobs(result.prompt_logprobs)
        progressed = self.scheduler.update_after_step(sched, result.sampled, result.accepted)
        self.generation_tokens += len(progressed)
        self._stamp_times(progressed)
        return progressed

    def _stamp_times(self, progressed: list[Request]) -> None:
        """Each request group's latest-token time and first scheduled step (metrics)."""
        now = time.monotonic()
        for request in progressed:
            entry = self._seq_of.get(request.request_id)
            if entry is None:
                continue
            group = entry[0]
            group.metrics["last_token_time"] = now
            if request.first_scheduled_time is not None:
                first = group.metrics.get("first_scheduled_time")
                if first is None or request.first_scheduled_time < first:
                    group.metrics["first_scheduled_time"] = request.first_scheduled_time

    def _process_tokens(
        self,
        progressed: list[Request],
        logprobs: dict,
        accepted: dict | None = None,
        accepted_logprobs: dict | None = None,
    ) -> dict[str, _Group]:
        """Detokenize and stop-check each new token (with speculative decoding, the
        accepted drafts before it, in turn); a request whose own processing (or sampling:
        `Sampler.take_row_errors`) failed is failed alone.  The groups touched."""
        accepted = accepted or {}
        row_errors = self.runner.take_row_errors()
        touched: dict[str, _Group] = {}
        for request in progressed:
            entry = self._seq_of.get(request.request_id)
            if entry is None:  # a sibling sample failed earlier in this loop
                continue
            group, seq = entry
            try:
                if request.request_id in row_errors:
                    raise RuntimeError(f"sampling failed: {row_errors[request.request_id]}")
                rid = request.request_id
                if rid in accepted:
                    self._process_drafted(
                        group, seq, len(accepted[rid]) + 1, (accepted_logprobs or {}).get(rid), logprobs.get(rid)
                    )
                else:
                    self._process_token(group, seq, logprobs.get(rid))
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                self._fail_group(group, e)
            touched[group.request_id] = group
        for rid, error in row_errors.items():  # a failed row that got no token this step
            if rid in self._seq_of:
                group = self._seq_of[rid][0]
                self._fail_group(group, RuntimeError(f"sampling failed: {error}"))
                touched[group.request_id] = group
        return touched

    def _store_prompt_logprobs(self, scored: dict[str, list]) -> None:
        for rid, entries in scored.items():
            found = self._seq_of.get(rid)
            if found is None or found[0].prompt_logprobs is None:
                continue
            store = found[0].prompt_logprobs
            for pos, tok_lp, rank, top in entries:
                entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(top)}
                entry[found[0].prompt_token_ids[pos]] = Logprob(tok_lp, rank)
                store[pos] = entry

    def _process_token(self, group: _Group, seq: _Sequence, lp) -> None:
        request = seq.request
        token = request.output_token_ids[-1]
        if seq.logprobs is not None and lp is not None:
            tok_lp, rank, top = lp
            entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(top)}
            entry[token] = Logprob(tok_lp, rank)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += tok_lp
        seq.text += seq.detok.step([token])
        status = request.check_stop_by_token()
        if status is None and request.structured is not None:
            status = finish_by_grammar(request, token)
        if status is None:
            status = self._check_stop_strings(seq)
        if status is not None:
            if request.stop_reason is None or not isinstance(request.stop_reason, str):
                seq.text += seq.detok.flush()  # an incomplete character held back at the end
            self._release(seq, status)
            group.metrics.setdefault("finished_time", time.monotonic())
        if request.first_token_time is not None:
            group.metrics.setdefault("first_token_time", request.first_token_time)

    def _fail_group(self, group: _Group, error: Exception) -> None:
        """Finish every sample of `group` with finish_reason "error", freeing its blocks."""
        logger.error("request %s failed; the other requests go on", group.request_id, exc_info=error)
        group.error = f"{type(error).__name__}: {error}"
        for seq in group.seqs:
            if seq.finish_reason is None:
                self._release(seq, RequestStatus.FINISHED_ABORTED)
                seq.finish_reason = "error"
        group.metrics.setdefault("finished_time", time.monotonic())

    def _process_drafted(self, group: _Group, seq: _Sequence, n: int, lps: list | None, last_lp) -> None:
        """The last ``n`` tokens of a step that verified drafts, one at a time as if
        sampled in turn: tokens after one that stops the request are dropped.  The step
        counted one generated token for the request; the others are counted here."""
        request = seq.request
        tokens = request.output_token_ids[-n:]
        del request.output_token_ids[-n:], request.all_token_ids[-n:]
        lps = (lps or [None] * (n - 1)) + [last_lp]
        for i, (token, lp) in enumerate(zip(tokens, lps)):
            request.append_token(token)
            self.generation_tokens += 1 if i else 0
            self._process_token(group, seq, lp)
            if seq.finish_reason is not None:
                break

    def _check_stop_strings(self, seq: _Sequence) -> RequestStatus | None:
        params = seq.request.sampling_params
        stops = params.stop_strings
        if not stops or seq.request.num_output_tokens < params.min_tokens:
            return None
        # Only the tail that the new token can have completed needs searching.
        window = len(seq.text) - (max(map(len, stops)) + 16)
        best = None
        for s in stops:
            idx = seq.text.find(s, max(window, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        seq.text = seq.text[: idx + len(s)] if params.include_stop_str_in_output else seq.text[:idx]
        seq.request.stop_reason = s
        return RequestStatus.FINISHED_STOPPED

    def _visible_text(self, seq: _Sequence) -> str:
        """While running, hold back a tail that could still become a stop string."""
        stops = seq.request.sampling_params.stop_strings
        if seq.finish_reason is not None or not stops:
            return seq.text
        hold = max(map(len, stops)) - 1
        return seq.text[: len(seq.text) - hold] if hold > 0 else seq.text

    def _make_output(self, group: _Group) -> RequestOutput | EmbeddingRequestOutput:
        if group.pool is not None:
            return self._embedding_output(group)
        outs = []
        seqs, params = group.seqs, group.params
        if params is not None and len(seqs) > params.n:
            # best_of: the n best samples once all are done; nothing before.
            seqs = best_sequences(seqs, params.n) if group.finished else []
        want_logprobs = params is None or params.logprobs is not None
        for index, seq in enumerate(seqs):
            r = seq.request
            outs.append(
                CompletionOutput(
                    index=index,
                    text=self._visible_text(seq),
                    token_ids=list(r.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=r.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None and want_logprobs else None,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                )
            )
        metrics = dict(group.metrics)
        metrics["arrival_time"] = group.arrival_time
        out = RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            outs,
            group.finished,
            group.seqs[0].request.num_cached_tokens,
            metrics,
            group.error,
        )
        if group.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [group.prompt_logprobs.get(p) for p in range(1, len(group.prompt_token_ids))]
        return out

    # -- KV hand-off between engines (disaggregated prefill/decode) ------------------------
    def export_prefix_kv(self, token_ids: list[int]) -> torch.Tensor:
        """KV of the prompt's leading cached full blocks, never the block of its last token:
        [num_layers, 2, num_blocks, *per-block shape] (see ModelRunner.read_kv_blocks)."""
        num_blocks = (len(token_ids) - 1) // self.kv.block_size
        return self.runner.read_kv_blocks(self.kv.cached_prefix(token_ids, num_blocks))

    def import_prefix_kv(self, token_ids: list[int], kv: torch.Tensor) -> int:
        """Cache ``kv`` (as export_prefix_kv returns it) as the prompt's leading blocks, as
        many as free blocks allow; returns how many were added (the rest is recomputed)."""
        rows, block_ids = self.kv.adopt_prefix(token_ids, kv.shape[2])
        if block_ids:
            self.runner.write_kv_blocks(block_ids, kv, rows)
        return len(block_ids)

    def empty_prefix_kv(self, num_blocks: int) -> torch.Tensor:
        """A buffer to receive ``num_blocks`` blocks of export_prefix_kv into."""
        return self.runner.empty_kv_blocks(num_blocks)

    def shutdown(self) -> None:
        """Stop worker processes or actors (a no-op for a single-process engine)."""
        self.executor.shutdown()
        self.structured.shutdown()
        if self.pipeline is not None:
            self.pipeline.shutdown()

    # -- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        host = self.kv.counters() if isinstance(self.kv, TieredKVCacheManager) else {}
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            iteration_tokens_buckets=tuple(itertools.accumulate(self._iteration_buckets)),
            iteration_tokens_sum=self._iteration_tokens_sum,
            **host,
            **(self.spec.counters() if self.spec is not None else {}),
        )
