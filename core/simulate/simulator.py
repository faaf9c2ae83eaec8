"""Drive the real Scheduler and KV-cache manager on a simulated clock.

Each iteration is one engine step: requests whose (simulated) arrival has come are
added, ``Scheduler.schedule()`` picks the batch exactly as in a real engine (token
budget, chunked prefill, prefix-cache lookups, preemption by recompute or swap, the
priority policy), the cost model prices that batch, the clock advances by the price,
and ``update_after_step`` appends one synthetic token per sampling request.  Requests
stop on their output length (``ignore_eos``, as the benchmarks run), so token counts
are exact.  No model, no weights, no torch.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.kv_cache.host_tier import IN, OUT, TieredKVCacheManager
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.simulate.cost_model import CostModel, StepBatch
from pagedserve.simulate.workload import SimRequest

__all__ = ["Simulator", "SimResult", "RequestTrace"]


@dataclass
class RequestTrace:
    """Simulated timeline of one request (seconds on the simulated clock)."""

    request_id: str
    sent: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        return None if self.output_len < 2 else (self.finished - self.first_token) / (self.output_len - 1)


@dataclass
class SimResult:
    requests: list[RequestTrace]
    num_steps: int
    elapsed: float
    #: (time, KV usage, running, waiting) after each step.
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_blocks: int = 0
    num_host_blocks: int = 0
    scheduled_tokens: int = 0
    busy_time: dict[str, float] = field(default_factory=dict)
    kv: KVCacheManager | None = None


class Simulator:
    """One simulated engine: a real Scheduler over a real KV-cache manager of
    ``num_blocks`` blocks (plus ``num_host_blocks`` on host when > 0)."""

    def __init__(
        self,
        cost: CostModel,
        cache: CacheConfig,
        sched: SchedulerConfig,
        num_blocks: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        seed: int = 0,
        vocab_size: int = 32000,
    ) -> None:
        self.cost = cost
        self.clock = 0.0
        if cache.block_size is None:  # the profile's platform default, as the engine resolves it
            cache = dataclasses.replace(cache, block_size=cost.block_size)
        if num_host_blocks > 0:
            self.kv: KVCacheManager = TieredKVCacheManager(
                num_blocks,
                cache.block_size,
                cache.enable_prefix_caching,
                num_host_blocks=num_host_blocks,
                swap_policy=None if cache.preemption_mode == "recompute" else self._swap_policy(cache.preemption_mode),
            )
        else:
            self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        # the platform's prompt-chunk default, as the engine passes it (a calibrated CPU: 512)
        self.scheduler = Scheduler(
            sched, self.kv, max_model_len, cost.hw.long_prefill_token_threshold, clock=lambda: self.clock
        )
        self.max_model_len = max_model_len
        self.num_host_blocks = num_host_blocks
        self._rng = random.Random(seed ^ 0x5EED)
        self._vocab = vocab_size

    def _swap_policy(self, mode: str):
        """pagedserve's swap-vs-recompute rule (offload/cost.py) with this cost model's rates."""
        hw, per_block = self.cost.hw, self.cost.kv_bytes_per_block()
        compute = hw.peak(self.cost.compute_kind) * hw.eff("matmul")
        host = hw.host_bandwidth * hw.eff("host")

        def policy(num_blocks: int, num_tokens: int) -> bool:
            if mode == "swap":
                return True
            return 2 * num_blocks * per_block / host < num_tokens * self.cost.flops_per_token() / compute

        return policy

    def _admit(self, req: SimRequest, i: int, sent: float, traces: dict[str, RequestTrace]) -> None:
        """``sent``: when the client sent it (its arrival, or when a concurrency slot freed);
        it reaches the scheduler at the next step boundary (now)."""
        rid = f"sim-{i}"
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        request = Request(
            rid, list(req.prompt_token_ids), params, frozenset(), sent, req.priority, None, self.max_model_len
        )
        self.scheduler.add_request(request)
        traces[rid] = RequestTrace(rid, sent, len(req.prompt_token_ids), req.output_len)

    def run(
        self, workload: list[SimRequest], max_concurrency: int | None = None, max_steps: int = 10_000_000
    ) -> SimResult:
        """Simulate until every request has finished."""
        pending = sorted(workload, key=lambda r: r.arrival)
        traces: dict[str, RequestTrace] = {}
        nxt, in_flight, steps = 0, 0, 0
        slot_freed = 0.0  # when a full --max-concurrency last let one more request go
        timeline: list[tuple[float, float, int, int]] = []
        busy: dict[str, float] = {}
        sched = self.scheduler
        while nxt < len(pending) or sched.has_unfinished():
            while (
                nxt < len(pending)
                and pending[nxt].arrival <= self.clock
                and (max_concurrency is None or in_flight < max_concurrency)
            ):
                self._admit(pending[nxt], nxt, max(pending[nxt].arrival, slot_freed), traces)
                nxt += 1
                in_flight += 1
            out = sched.schedule()
            if out.empty:
                if nxt < len(pending) and (max_concurrency is None or in_flight < max_concurrency):
                    self.clock = max(self.clock, pending[nxt].arrival)
                    continue
                raise RuntimeError(
                    f"simulation stuck at t={self.clock:.3f}s: {sched.num_waiting} waiting, "
                    f"{sched.num_running} running, nothing schedulable"
                )
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"simulation exceeded {max_steps} steps")
            batch = StepBatch(
                q_lens=[s.num_new_tokens for s in out.scheduled],
                ctx_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled],
                num_samples=sum(1 for s in out.scheduled if s.samples),
                blocks_in=out.kv_transfers.num_blocks(IN) if out.kv_transfers else 0,
                blocks_out=out.kv_transfers.num_blocks(OUT) if out.kv_transfers else 0,
            )
            parts = self.cost.breakdown(batch)
            for k, v in parts.items():
                busy[k] = busy.get(k, 0.0) + v
            self.clock += sum(parts.values())
            sampled = {s.request.request_id: self._rng.randrange(100, self._vocab) for s in out.scheduled if s.samples}
            for request in sched.update_after_step(out, sampled):
                trace = traces[request.request_id]
                if trace.first_token is None:
                    trace.first_token = self.clock
                status = request.check_stop_by_token()
                if status is not None:
                    trace.finished = self.clock
                    trace.cached_tokens = request.num_cached_tokens
                    trace.preemptions = request.num_preemptions
                    sched.finish_request(request.request_id, status)
                    if max_concurrency is not None and in_flight == max_concurrency:
                        slot_freed = self.clock
                    in_flight -= 1
            timeline.append((self.clock, self.kv.usage(), sched.num_running, sched.num_waiting))
        return SimResult(
            requests=list(traces.values()),
            num_steps=steps,
            elapsed=self.clock,
            timeline=timeline,
            num_preemptions=sched.num_preemptions,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_blocks=self.kv.num_blocks,
            num_host_blocks=self.num_host_blocks,
            scheduled_tokens=self.kv.num_scheduled_tokens,
            busy_time=busy,
            kv=self.kv,
        )
