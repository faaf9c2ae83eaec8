"""Every paged_attention implementation of the CPU platform, by name, for the platform's
choice (platforms/cpu/ops.py) and for a measured dispatch.

Candidates (each with kernels/reference.py's exact signature):
    native       the native kernel (kernels/cpu/attention.h), every ISA, every feature.
    amx          AMX bf16 tiles (kernels/cpu/attention_amx.cpp) for every sequence;
                 only where the CPU has AMX.
    amx_prefill  AMX for the sequences with at least PREFILL_MIN_TOKENS query tokens,
                 native for the rest (decodes) of the same batch; only with AMX.
    bf16_tiles   the same scheme on AVX-512 BF16 registers (kernels/cpu/prefill_attn_bf16.cpp)
                 for every sequence; only where the CPU has AVX-512 BF16 and no AMX.
    bf16_prefill bf16_tiles for the sequences with at least PREFILL_MIN_TOKENS query
                 tokens, native for the rest; likewise.
    sdpa         torch's scaled_dot_product_attention per sequence over K/V gathered
                 from the blocks (oneDNN/brgemm flash attention, AMX where it exists).

The AMX kernel packs each sequence's keys and values into tile layouts once per call,
which the query tiles of a prefill chunk share; a decode's 3 rows of a 16-row tile do
not amortise that, and the native kernel is faster there (docs/kernels_cpu.md, "AMX
attention", has the crossover).  The AVX-512 BF16 kernel packs alike and has the same
crossover ("Prefill attention on AVX-512 BF16 registers").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.native import count_call, count_fallback

__all__ = [
    "PREFILL_MIN_TOKENS",
    "WHOLE_BATCH",
    "attention_candidates",
    "call_runs",
    "make_prefill_split",
    "make_rotary_paged_attention",
    "sdpa_paged_attention",
]

#: Query tokens from which a sequence goes to the AMX kernel in ``amx_prefill``.  With
#: the default model's heads (9 query / 3 kv, head size 64, 1024 keys) AMX measured
#: 0.7x native at 4 tokens and 1.9x at 16 (docs/kernels_cpu.md).
PREFILL_MIN_TOKENS = 8

AttentionFn = Callable[..., torch.Tensor]
#: The candidates that run a whole batch one way (measured dispatch times these and
#: splits batches itself; ``amx_prefill`` is already a split).
WHOLE_BATCH = ("native", "amx", "bf16_tiles", "sdpa")


def call_runs(
    fns: Sequence[AttentionFn],
    qsl: Sequence[int],
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """paged_attention with sequence i run by ``fns[i]`` (``qsl``: query_start_loc as a
    list): each maximal run of consecutive sequences with the same implementation is
    one call on slices of the batch (views, no copies); one run is the whole batch."""
    num_seqs = len(fns)
    start = 0
    for i in range(1, num_seqs + 1):
        if i < num_seqs and fns[i] is fns[start]:
            continue
        if start == 0 and i == num_seqs:
            return fns[0](query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)
        a, b = qsl[start], qsl[i]
        fns[start](
            query[a:b],
            key_cache,
            value_cache,
            block_tables[start:i],
            seq_lens[start:i],
            query_start_loc[start : i + 1] - a,
            scale,
            out[a:b],
        )
        start = i
    return out


def make_prefill_split(prefill: AttentionFn, decode: AttentionFn, min_tokens: int = PREFILL_MIN_TOKENS) -> AttentionFn:
    """paged_attention running ``prefill`` on the sequences with at least ``min_tokens``
    query tokens and ``decode`` on the others, by runs of consecutive sequences
    (:func:`call_runs`).  Windows, soft caps, sinks and key ends go to ``decode``
    whole (the native kernel has them)."""

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
        args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
        num_seqs = seq_lens.shape[0]
        # A decode step (one token per sequence) never reaches the tiles: decided
        # without reading the metadata.
        extras = sliding_window or soft_cap or sinks is not None or key_ends is not None
        if query.shape[0] < min_tokens or query.shape[0] <= num_seqs or extras:
            extra = {"key_ends": key_ends} if key_ends is not None else {}
            return decode(*args, out, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, **extra)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        qsl = query_start_loc.tolist()
        fns = [prefill if qsl[i + 1] - qsl[i] >= min_tokens else decode for i in range(num_seqs)]
        return call_runs(fns, qsl, *args, out)

    return paged_attention


def make_rotary_paged_attention(native: Any, ops: Any, decode_native: Callable[..., bool] | None = None) -> Callable:
    """rotary_paged_attention (reference.rotary_paged_attention) of the CPU platform: a
    decode step (one query token per sequence) whose attention is the native kernel
    goes to the native fused call (kernels/cpu/native.py: rotary, cache write and
    attention in one call); anything else (prefill chunks, which the tiled kernels may
    take) runs ``ops``'s own rotary_embedding, reshape_and_cache and paged_attention.
    ``decode_native(query, key_cache)``: whether the registry's paged_attention runs a
    decode step over that cache on the native kernel (measured dispatch may choose
    another); None: it always does."""
    fused = native.rotary_paged_attention

    def rotary_paged_attention(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See reference.rotary_paged_attention."""
        if 0 < query.shape[0] <= seq_lens.shape[0] and (decode_native is None or decode_native(query, key_cache)):
            return fused(
                positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
                block_tables, seq_lens, query_start_loc, scale, out,
            )  # fmt: skip
        query, key = ops.rotary_embedding(positions, query, key, cos_sin_cache)
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)

    return rotary_paged_attention


def _gather(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[num_kv_heads, ctx, head_size] of one sequence's rows of ``cache``."""
    bs = cache.shape[1]
    blocks = cache.index_select(0, table[: (ctx + bs - 1) // bs].long())
    return blocks.flatten(0, 1)[:ctx].transpose(0, 1)


def sdpa_paged_attention(
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
    """See reference.paged_attention: per sequence, its K/V gathered from the blocks and
    torch's scaled_dot_product_attention with the causal mask aligned to the end of
    the context (a chunk's queries are the last positions), or each row's keys below
    its ``key_ends``.  Windows, soft caps, sinks and 8-bit float caches run the
    reference."""
    if sliding_window or soft_cap or sinks is not None or key_cache.dtype != query.dtype:
        count_fallback("paged_attention", "torch SDPA candidate with a window, soft cap, sinks or an 8-bit cache")
        return reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, key_ends=key_ends,
        )  # fmt: skip
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    count_call("paged_attention:sdpa")
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        a, b = qsl[i], qsl[i + 1]
        if b == a:
            continue
        k = _gather(key_cache, block_tables[i], ctx).unsqueeze(0)
        v = _gather(value_cache, block_tables[i], ctx).unsqueeze(0)
        q = query[a:b].transpose(0, 1).unsqueeze(0)
        # The causal mask aligned to the end of the context, as a plain boolean tensor:
        # torch.nn.attention.bias's causal_lower_right runs the same kernel but its
        # import costs seconds in a fresh process (a measured-dispatch tuning figure).
        mask: Any = torch.ones(b - a, ctx, dtype=torch.bool).tril(ctx - (b - a)) if b - a > 1 else None
        if key_ends is not None:
            ends = key_ends[a:b].long().view(-1, 1)
            own = torch.arange(ctx - (b - a) + 1, ctx + 1).view(-1, 1)
            if bool((ends < own).any()) or bool((ends > ctx).any()):
                raise ValueError(f"sequence {i}: key_ends must lie in [position + 1, seq_len={ctx}]")
            mask = torch.arange(ctx).view(1, ctx) < ends
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b].copy_(o[0].transpose(0, 1))
    return out


def attention_candidates(native: Any) -> dict[str, AttentionFn]:
    """Every paged_attention implementation available here, by name (module doc);
    ``native`` is the loaded native kernels (kernels/cpu/native.py) or None."""
    from pagedserve.kernels.cpu.attention_amx import load_amx_attention
    from pagedserve.kernels.cpu.prefill_attn import load_bf16_prefill_attention

    candidates: dict[str, AttentionFn] = {}
    if native is not None:
        candidates["native"] = native.paged_attention
    amx = load_amx_attention()
    if amx is not None:
        if native is not None:  # what the tiles do not take (windows, fp32, ...) runs native
            amx = amx.with_fallback(native.paged_attention)
        candidates["amx"] = amx.paged_attention
        if native is not None:
            candidates["amx_prefill"] = make_prefill_split(amx.paged_attention, native.paged_attention)
    else:  # no AMX: the same tiling on AVX-512 BF16 registers, where the CPU has them
        tiles = load_bf16_prefill_attention()
        if tiles is not None:
            if native is not None:
                tiles = tiles.with_fallback(native.paged_attention)
            candidates["bf16_tiles"] = tiles.paged_attention
            if native is not None:
                candidates["bf16_prefill"] = make_prefill_split(tiles.paged_attention, native.paged_attention)
    candidates["sdpa"] = sdpa_paged_attention
    return candidates
