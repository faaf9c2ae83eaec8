"""The engine's statistics: the snapshot it reports (`EngineStats`) and the step counters
behind it (`StepCounters`)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EngineStats", "ITERATION_TOKEN_BUCKETS", "KVCacheCounters", "StepCounters"]

#: Upper bounds of the steps-by-batched-tokens histogram (vLLM's iteration_tokens_total).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
    kv_connector_blocks_loaded: int = 0  # prefix blocks loaded from the KV connector's store (kv_connector)
    kv_connector_blocks_saved: int = 0  # full blocks saved to the KV connector's store
    #: Steps by tokens scheduled, cumulative per bucket of ITERATION_TOKEN_BUCKETS (the
    #: last count is the +Inf bucket), and the tokens of all steps together.
    iteration_tokens_buckets: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    spec_decode_num_drafts: int = 0  # verification steps of requests with drafts
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified
    spec_decode_num_accepted_tokens: int = 0  # draft tokens accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at draft position 0, 1, ...


class KVCacheCounters(Protocol):
    """What the statistics read of a KV-cache manager: the plain one, the grouped one
    (layers with different windows) and the one with a host tier all provide it."""

    prefix_queries: int
    prefix_hits: int

    def usage(self) -> float: ...

    def counters(self) -> dict[str, int | float]:
        """Further gauges and counters, named as ``EngineStats`` fields (the host tier's)."""
        ...


class SchedulerCounters(Protocol):
    num_running: int
    num_waiting: int
    num_preemptions: int


class StepCounters:
    """Tokens computed and generated, and the steps-by-batched-tokens histogram."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._buckets = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._tokens_sum = 0

    def count_step(self, sched) -> None:
        """A scheduled step, before the scheduler advances its requests: its batched
        tokens into the histogram, and the prompt tokens it computes."""
        self._buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, sched.num_batched_tokens)] += 1
        self._tokens_sum += sched.num_batched_tokens
        for s in sched.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self.prompt_tokens += min(s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)

    def count_generated(self, n: int) -> None:
        self.generation_tokens += n

    def snapshot(self, scheduler: SchedulerCounters, kv: KVCacheCounters, extra: dict) -> EngineStats:
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            iteration_tokens_buckets=tuple(itertools.accumulate(self._buckets)),
            iteration_tokens_sum=self._tokens_sum,
            **kv.counters(),
            **extra,
        )
