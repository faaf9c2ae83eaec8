"""Block arithmetic of sliding-window attention: which KV blocks no query can see any more.

With a window ``W`` the query at position ``p`` sees keys ``p - W < k <= p``.  Before a
step that computes tokens from ``num_computed_tokens`` on, no query of that step (nor of
any later one) sees a key before ``first_visible = max(0, num_computed_tokens - W + 1)``,
so the blocks that lie entirely before it can go back to the pool; their block-table
entries then point at a reserved null block that is never allocated nor written, and
every ``paged_attention`` implementation starts its key loop at block
``first_visible // block_size`` (docs/models.md, "Sliding windows").

Freeing applies to a manager whose layers all have the same window: every layer of
Mistral v0.1, Starcoder2, Mixtral with a window, Qwen2 with sliding on every layer; or
one windowed KV cache group of a model whose layers differ (Gemma 2/3, Qwen2
``max_window_layers``: see :mod:`pagedserve.kv_cache.kv_groups`), whose full-attention
group keeps every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "uniform_window",
    "first_visible_block",
    "max_blocks_held",
    "blocks_for_one_request",
    "kv_window_for_pool",
]


def uniform_window(windows: Sequence[int | None] | None) -> int | None:
    """The window every layer shares, or None when some layer attends to every key or
    the windows differ (then no block can be freed while its request runs), or for
    layers with a recurrent state (``config_rules.RECURRENT_STATE``)."""
    if not windows or not isinstance(windows[0], int) or any(w != windows[0] for w in windows):
        return None
    return int(windows[0])


def first_visible_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Index of the first block a query of the next step may see: every block before it
    slid out of the window for good (later queries only see later keys)."""
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_held(num_tokens: int, block_size: int, window: int | None, max_step_tokens: int) -> int:
    """Most blocks one request of up to ``num_tokens`` tokens holds at once when no step
    computes more than ``max_step_tokens`` of its tokens.

    A step computing ``q`` tokens after ``c`` holds the blocks from the one holding
    ``first_visible = c - W + 1`` to the one holding token ``c + q - 1``.  The count only
    grows with ``c`` up to ``W - 1``, repeats with period ``block_size`` while steps are
    whole, and only shrinks over the last step; so a few starting points give the maximum.
    """
    n, bs = num_tokens, block_size
    if window is None or n < 1:
        return -(-n // bs)

    def held(c: int) -> int:
        q = min(max_step_tokens, n - c)
        return -(-(c + q) // bs) - max(0, c - window + 1) // bs

    last_whole = n - max_step_tokens - 1  # last start of a whole step
    starts = {0, max(0, n - max_step_tokens), min(window - 1, max(last_whole, 0))}
    starts.update(range(window - 1, min(window - 1 + bs, last_whole + 1)))
    return max(held(c) for c in starts if 0 <= c < n)


def blocks_for_one_request(cache: Any, sched: Any, max_model_len: int, windows: Sequence[int | None] | None) -> int:
    """KV blocks a pool needs to run one request of ``max_model_len`` tokens with these
    settings (``cache``: CacheConfig, ``sched``: SchedulerConfig) and layer ``windows``:
    every block of it, or with freeing on, a window's worth plus the null block when
    that is fewer (otherwise the manager keeps every block: see :func:`kv_window_for_pool`)."""
    full = -(-max_model_len // cache.block_size)
    window = uniform_window(windows) if cache.free_sliding_window_blocks and cache.kv_offload_memory is None else None
    if window is None:
        return full
    return min(full, max_blocks_held(max_model_len, cache.block_size, window, sched.max_num_batched_tokens) + 1)


def kv_window_for_pool(window: int | None, num_blocks: int, cache: Any, sched: Any, max_model_len: int) -> int | None:
    """``window`` when a pool of ``num_blocks`` runs a max-length request with one block
    set aside as the null block; None (keep every block) when only the whole pool fits it."""
    if window is None:
        return None
    held = max_blocks_held(max_model_len, cache.block_size, window, sched.max_num_batched_tokens)
    return window if num_blocks >= held + 1 else None
