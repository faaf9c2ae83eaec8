"""Sliding-window and soft-cap cases of the paged_attention conformance checks.

A window shorter than a sequence lets the KV manager free the blocks that slid out of
it and point their block-table entries at a reserved null block whose content is
arbitrary (``kernels/reference.py`` states the contract).  These cases build that
state: contexts several windows long, every slid-out entry pointing at a block filled
with NaN, so an implementation that reads one (even to multiply it by a zero
probability) returns NaN.  The expected output is the reference's on the original
block tables.
"""

from __future__ import annotations

import torch

__all__ = [
    "SINK_CASES",
    "SPAN_CASES",
    "WINDOW_BATCH",
    "WINDOW_CASES",
    "point_slid_out_at_nan_block",
    "random_key_ends",
    "random_sinks",
]

#: (context length, new tokens) per sequence: a one-token prompt, decodes far past the
#: window, a whole prompt longer than the window, a prefill chunk after cached context.
WINDOW_BATCH: tuple[tuple[int, int], ...] = ((1, 1), (70, 1), (64, 64), (90, 12), (130, 1), (29, 29))

#: (block_size, heads, kv_heads, head_size, extra): small blocks (many freed), GQA 1-4,
#: head sizes 64/80/96/128, windows of 1 and shorter than every chunk, soft-cap with
#: and without a window.
WINDOW_CASES: tuple[tuple[int, int, int, int, dict], ...] = (
    (4, 4, 2, 64, {"sliding_window": 7}),
    (16, 8, 2, 64, {"sliding_window": 40}),
    (16, 6, 2, 80, {"sliding_window": 33, "soft_cap": 5.0}),
    (8, 4, 4, 96, {"sliding_window": 1}),
    (32, 4, 1, 128, {"soft_cap": 2.0}),
)

#: Attention sinks (GPT-OSS): ``{"sinks": spread}`` stands for float32 [heads] random
#: sink logits of that spread (``random_sinks``); 30 makes the sink dominate every
#: score.  Alone, with a window (long contexts, slid-out entries at the NaN block), with
#: soft-cap, GQA 1-4.
SINK_CASES: tuple[tuple[int, int, int, int, dict], ...] = (
    (16, 4, 2, 64, {"sinks": 1.0}),
    (16, 8, 2, 64, {"sliding_window": 40, "sinks": 2.0}),
    (8, 4, 1, 64, {"sliding_window": 7, "soft_cap": 5.0, "sinks": 30.0}),
    (32, 6, 2, 128, {"sinks": 30.0}),
)


#: Spans attending both ways (``key_ends``; Gemma 3's images): ``{"key_ends": n}``
#: stands for up to n random spans among each sequence's query tokens
#: (``random_key_ends``).  Alone, with windows shorter and longer than the spans (long
#: contexts, slid-out entries at the NaN block), with soft-cap, GQA 1-4.
SPAN_CASES: tuple[tuple[int, int, int, int, dict], ...] = (
    (16, 4, 2, 64, {"key_ends": 2}),
    (4, 4, 2, 64, {"sliding_window": 7, "key_ends": 3}),
    (16, 8, 2, 128, {"sliding_window": 40, "key_ends": 1}),
    (8, 6, 2, 80, {"sliding_window": 33, "soft_cap": 5.0, "key_ends": 2}),
)


def random_key_ends(
    gen: torch.Generator, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, spans: int
) -> torch.Tensor:
    """int32 [num_tokens] ``key_ends`` with up to ``spans`` random disjoint spans of at
    least two tokens among each sequence's query tokens: a span's tokens see keys up to
    its end, every other token up to its own position."""
    qsl = query_start_loc.tolist()
    out = []
    for i, ctx in enumerate(seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        ends = list(range(ctx - q_len + 1, ctx + 1))
        if q_len >= 2:
            cuts = sorted(torch.randperm(q_len + 1, generator=gen)[: 2 * spans].tolist())
            for a, b in zip(cuts[0::2], cuts[1::2]):
                if b - a >= 2:
                    ends[a:b] = [ctx - q_len + b] * (b - a)
        out += ends
    return torch.tensor(out, dtype=torch.int32)


def random_sinks(gen: torch.Generator, heads: int, spread: float) -> torch.Tensor:
    """float32 [heads] sink logits, normal with standard deviation ``spread``."""
    return torch.randn(heads, generator=gen) * spread


def point_slid_out_at_nan_block(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Caches [num_blocks, block_size, kv_heads, head] with one NaN block appended, and
    a copy of block_tables [num_seqs, max_blocks] whose entries before each sequence's
    first visible block, max(0, ctx - q_len - window + 1) // block_size, name it.

    Returns (key_cache, value_cache, block_tables, null_block); with no window nothing
    slides out and only the block is appended."""
    null = key_cache.shape[0]
    nan_k = torch.full_like(key_cache[:1], float("nan"))
    key_cache = torch.cat([key_cache, nan_k])
    value_cache = torch.cat([value_cache, nan_k.to(value_cache.dtype)])
    tables = block_tables.clone()
    if sliding_window is not None:
        block_size = key_cache.shape[1]
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        for i, ctx in enumerate(seq_lens.tolist()):
            tables[i, : max(0, ctx - q_lens[i] - sliding_window + 1) // block_size] = null
    return key_cache, value_cache, tables, null
