"""paged_attention dispatched by measurement (platforms/cpu/tuning.py).

At the first call for a head configuration (query heads, kv heads, head size, dtype,
block size and KV layout, read from that call's tensors) the whole-batch candidates of
platforms/cpu/attention_ops.py (``native``, ``amx``, ``sdpa``; ``amx_prefill`` is itself a
split) are timed on synthetic paged inputs of the same configuration, at :data:`BUCKETS`
query tokens per sequence over a :data:`CONTEXT`-token context (the 512-token bucket a
prefill from scratch).  A bucket's batch holds ``TOKENS // q`` sequences, at least one
and at most :data:`DECODE_BATCH`: a decode bucket is a batch of 8 decodes, as a decode
step runs them.  Short inputs keep the tuning cost small (docs/kernels_cpu.md).  The
plan is cached per machine like the linears' (same file, same identity).

Each call then picks, per sequence, the candidate of its query-token bucket (the
smallest tuned bucket at or above its token count) and runs each maximal run of
consecutive sequences with one candidate as one call (attention_ops.call_runs): a
mixed batch of decodes and prefill chunks runs its decodes on the native kernel and its
chunks on AMX tiles where that measured fastest.  A decode step (one token per
sequence) is one call, decided without reading the metadata.

Windows, soft caps, sinks and dtypes other than bf16 (8-bit float caches included) go
to the static choice (the native kernel runs them; the tiles take bf16 only): nothing
is timed for them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping

import torch

from pagedserve.platforms.cpu.attention_ops import AttentionFn, call_runs
from pagedserve.platforms.cpu.tuning import Plan, Tuner, plan_rows

__all__ = ["BUCKETS", "CONTEXT", "DECODE_BATCH", "OP", "TunedAttention", "head_key", "synthetic_batch"]

log = logging.getLogger(__name__)

OP = "paged_attention"
#: Query tokens per sequence timed: decodes, speculative/short chunks, prefill chunks.
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 64, 512)
#: Keys per sequence in the synthetic batches (the query tokens are its last ones).
CONTEXT = 512
#: Sequences in a decode bucket's batch; larger buckets hold TOKENS // q sequences.
DECODE_BATCH = 8
TOKENS = 64
#: Decode kernels remembered per KV cache tensor (a model has one per layer).
_MAX_DECODE_ENTRIES = 1024


def kv_layout(key_cache: torch.Tensor) -> str:
    """ "head" where each kv head's rows of a block are together (the CPU platform's
    default allocation, a transposed view), else "token"."""
    return "head" if key_cache.stride(1) < key_cache.stride(2) else "token"


def head_key(query: torch.Tensor, key_cache: torch.Tensor) -> str:
    """The configuration that decides the candidates' speed, as the plan's key."""
    _, heads, size = query.shape
    _, block, kv, _ = key_cache.shape
    dtype = str(query.dtype).removeprefix("torch.")
    return f"H={heads},KV={kv},D={size},bs={block},{dtype},{kv_layout(key_cache)}"


def synthetic_batch(
    q_len: int,
    num_seqs: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    layout: str,
) -> tuple:
    """paged_attention's arguments (with ``out``) for ``num_seqs`` sequences of ``q_len``
    query tokens over ``context`` keys each, every sequence on its own blocks."""
    context = max(context, q_len)
    per_seq = (context + block_size - 1) // block_size
    num_blocks = per_seq * num_seqs
    if layout == "head":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        key_cache = torch.randn(shape).to(dtype).transpose(1, 2)
        value_cache = torch.randn(shape).to(dtype).transpose(1, 2)
    else:
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    query = torch.randn(num_seqs * q_len, num_heads, head_size).to(dtype)
    out = torch.empty_like(query)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, head_size**-0.5, out


class TunedAttention:
    """The tuned paged_attention: :meth:`op` is the registry's op."""

    def __init__(
        self,
        tuner: Tuner,
        candidates: Mapping[str, AttentionFn],
        static: AttentionFn,
        buckets: tuple[int, ...] = BUCKETS,
        context: int = CONTEXT,
    ) -> None:
        """``candidates``: whole-batch implementations by name; ``static``: the op that
        runs what is not tuned (windows, soft caps, sinks, other dtypes)."""
        self.tuner, self.candidates, self.static = tuner, dict(candidates), static
        self.buckets, self.context = tuple(sorted(buckets)), context
        #: Plans by head_key (tests inject their own).
        self.plans: dict[str, Plan] = {}
        self._routes: dict[str, tuple[tuple[int, ...], list[AttentionFn]]] = {}
        #: A decode step's kernel by KV cache tensor (``id``; the entry holds a weak
        #: reference that proves it is the same tensor, its query dtype and heads): a
        #: decode layer finds it in one lookup instead of building its head_key string
        #: (~2 us, 30 calls a step).
        self._decode: dict[int, tuple[weakref.ref, torch.dtype, int, AttentionFn]] = {}

    # -- tuning -------------------------------------------------------------------------
    def _runner(self, name: str, query: torch.Tensor, key_cache: torch.Tensor) -> Callable:
        fn = self.candidates[name]
        _, heads, size = query.shape
        _, block, kv, _ = key_cache.shape
        layout = kv_layout(key_cache)

        def make(q_len: int):
            seqs = max(1, min(DECODE_BATCH, TOKENS // q_len))
            args = synthetic_batch(q_len, seqs, self.context, heads, kv, size, block, query.dtype, layout)
            return lambda: fn(*args)

        return make

    def route(self, query: torch.Tensor, key_cache: torch.Tensor) -> tuple[tuple[int, ...], list[AttentionFn]]:
        """(buckets, the implementation per bucket) for this head configuration (tuned
        on first use)."""
        key = head_key(query, key_cache)
        found = self._routes.get(key)
        if found is None:
            plan = self.plans.get(key)
            if plan is None:
                runners = {n: self._runner(n, query, key_cache) for n in self.candidates}
                with torch.inference_mode():
                    plan = self.tuner.tune(OP, key, runners, self.buckets)
                self.plans[key] = plan
            found = (plan.buckets, [self.candidates[plan.chosen[b]] for b in plan.buckets])
            self._routes[key] = found
        return found

    @staticmethod
    def _pick(buckets: tuple[int, ...], route: list[AttentionFn], q_len: int) -> AttentionFn:
        for b, fn in zip(buckets, route):
            if q_len <= b:
                return fn
        return route[-1]

    # -- step ---------------------------------------------------------------------------
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        key_ends: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See reference.paged_attention."""
        args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
        if key_ends is not None:  # measured without them: the static choice runs them
            return self.static(
                *args, out, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, key_ends=key_ends
            )
        if (
            sliding_window
            or soft_cap
            or sinks is not None
            or query.dtype != torch.bfloat16
            or key_cache.dtype != torch.bfloat16  # an 8-bit float cache: the native kernel's path
            or query.shape[0] == 0
        ):
            return self.static(*args, out, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        buckets, route = self.route(query, key_cache)
        num_seqs = seq_lens.shape[0]
        if query.shape[0] <= num_seqs:  # a decode step: one call, no metadata read
            self._remember_decode(query, key_cache, route[0])
            return route[0](*args, out)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        qsl = query_start_loc.tolist()
        fns = [self._pick(buckets, route, qsl[i + 1] - qsl[i]) for i in range(num_seqs)]
        return call_runs(fns, qsl, *args, out)

    def decode_kernel(self, query: torch.Tensor, key_cache: torch.Tensor) -> AttentionFn:
        """The candidate a decode step (one bf16 query token per sequence, no window, cap,
        sinks or key ends) over ``key_cache`` runs (tuned on first use): what a fused op
        that embeds one kernel asks before it takes the step."""
        found = self._decode.get(id(key_cache))
        if found is not None and found[0]() is key_cache and found[1] is query.dtype and found[2] == query.shape[1]:
            return found[3]
        fn = self.route(query, key_cache)[1][0]
        self._remember_decode(query, key_cache, fn)
        return fn

    def _remember_decode(self, query: torch.Tensor, key_cache: torch.Tensor, fn: AttentionFn) -> None:
        """Keep ``fn`` as the decode kernel of ``key_cache`` (see :meth:`op`); the entry goes
        when the tensor does (a cache that is rebuilt, or a view made per call, never
        piles up entries), and at most ``_MAX_DECODE_ENTRIES`` are kept."""
        decode = self._decode
        if len(decode) >= _MAX_DECODE_ENTRIES:
            decode.clear()
        key = id(key_cache)
        ref = weakref.ref(key_cache, lambda _, key=key: decode.pop(key, None))
        decode[key] = (ref, query.dtype, query.shape[1], fn)

    def op(self) -> AttentionFn:
        """:meth:`paged_attention` as the registry's op, carrying ``tuning_report()``.  A
        decode step (one query token per sequence, no window, cap, sinks or key ends) on a
        KV cache that already ran one goes straight to that kernel."""
        decode = self._decode

        def paged_attention(
            query: torch.Tensor,
            key_cache: torch.Tensor,
            value_cache: torch.Tensor,
            block_tables: torch.Tensor,
            seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor,
            scale: float,
            out: torch.Tensor | None = None,
            sliding_window: int | None = None,
            soft_cap: float | None = None,
            sinks: torch.Tensor | None = None,
            key_ends: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """See reference.paged_attention (TunedAttention.paged_attention)."""
            if (
                sliding_window is None
                and soft_cap is None
                and sinks is None
                and key_ends is None
                and 0 < query.shape[0] <= seq_lens.shape[0]
            ):
                found = decode.get(id(key_cache))
                if (
                    found is not None
                    and found[0]() is key_cache
                    and found[1] is query.dtype
                    and found[2] == query.shape[1]
                ):
                    return found[3](query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)
            return self.paged_attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, key_ends=key_ends,
            )  # fmt: skip

        paged_attention.tuning_report = self.report  # type: ignore[attr-defined]
        return paged_attention

    def report(self) -> list[dict]:
        """Rows of every paged_attention plan cached for this machine (else this process's)."""
        cache = self.tuner.cache
        plans = cache.plans() if cache is not None else self.tuner.plans.values()
        return plan_rows([p for p in plans if p.op == OP])
