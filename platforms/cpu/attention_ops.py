"""Every paged_attention implementation of the CPU platform, by name, for the platform's
choice (platforms/cpu/ops.py) and for a measured dispatch.

Candidates (each with kernels/reference.py's exact signature):
    native       the native kernel (kernels/cpu/attention.h), every ISA, every feature.
    amx          AMX bf16 tiles (kernels/cpu/attention_amx.cpp) for every sequence;
                 only where the CPU has AMX.
    amx_prefill  AMX for the sequences with at least PREFILL_MIN_TOKENS query tokens,
                 native for the rest (decodes) of the same batch; only with AMX.
    sdpa         torch's scaled_dot_product_attention per sequence over K/V gathered
                 from the blocks (oneDNN/brgemm flash attention, AMX where it exists).

The AMX kernel packs each sequence's keys and values into tile layouts once per call,
which the query tiles of a prefill chunk share; a decode's 3 rows of a 16-row tile do
not amortise that, and the native kernel is faster there (docs/kernels_cpu.md, "AMX
attention", has the crossover).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.kernels import reference

__all__ = ["PREFILL_MIN_TOKENS", "attention_candidates", "make_prefill_split", "sdpa_paged_attention"]

#: Query tokens from which a sequence goes to the AMX kernel in ``amx_prefill``.  With
#: the default model's heads (9 query / 3 kv, head size 64, 1024 keys) AMX measured
#: 0.7x native at 4 tokens and 1.9x at 16 (docs/kernels_cpu.md).
PREFILL_MIN_TOKENS = 8

AttentionFn = Callable[..., torch.Tensor]


def make_prefill_split(prefill: AttentionFn, decode: AttentionFn, min_tokens: int = PREFILL_MIN_TOKENS) -> AttentionFn:
    """paged_attention running ``prefill`` on the sequences with at least ``min_tokens``
    query tokens and ``decode`` on the others: each maximal run of consecutive
    sequences of one kind is one call on slices of the batch (views, no copies).
    Windows, soft caps and sinks go to ``decode`` whole (the native kernel has them)."""

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
    ) -> torch.Tensor:
        args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
        num_seqs = seq_lens.shape[0]
        # A decode step (one token per sequence) never reaches the tiles: decided
        # without reading the metadata.
        if query.shape[0] < min_tokens or query.shape[0] <= num_seqs or sliding_window or soft_cap or sinks is not None:
            return decode(*args, out, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        qsl = query_start_loc.tolist()
        big = [qsl[i + 1] - qsl[i] >= min_tokens for i in range(num_seqs)]
        if all(big):
            return prefill(*args, out)
        if not any(big):
            return decode(*args, out)
        start = 0
        for i in range(1, num_seqs + 1):
            if i < num_seqs and big[i] == big[start]:
                continue
            a, b = qsl[start], qsl[i]
            fn = prefill if big[start] else decode
            fn(
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

    return paged_attention


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
) -> torch.Tensor:
    """See reference.paged_attention: per sequence, its K/V gathered from the blocks and
    torch's scaled_dot_product_attention with the causal mask aligned to the end of
    the context (a chunk's queries are the last positions).  Windows, soft caps and
    sinks run the reference."""
    if sliding_window or soft_cap or sinks is not None:
        return reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
    from torch.nn.attention.bias import causal_lower_right

    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        a, b = qsl[i], qsl[i + 1]
        if b == a:
            continue
        k = _gather(key_cache, block_tables[i], ctx).unsqueeze(0)
        v = _gather(value_cache, block_tables[i], ctx).unsqueeze(0)
        q = query[a:b].transpose(0, 1).unsqueeze(0)
        mask: Any = causal_lower_right(b - a, ctx) if b - a > 1 else None
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b].copy_(o[0].transpose(0, 1))
    return out


def attention_candidates(native: Any) -> dict[str, AttentionFn]:
    """Every paged_attention implementation available here, by name (module doc);
    ``native`` is the loaded native kernels (kernels/cpu/native.py) or None."""
    from pagedserve.kernels.cpu.attention_amx import load_amx_attention

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
    candidates["sdpa"] = sdpa_paged_attention
    return candidates
