"""Recurrent-layer state in the paged KV cache: read and write a layer's per-request state
through its KV cache group's state pages (pagedserve.kv_cache.state_group).

A recurrent layer (Gated DeltaNet, Mamba 2) is given the (key, value) tensors of its
group's slot like any layer; its group's block table lists, per request, the ``pages``
pages that hold its state.  The state is the concatenation of the layer's state tensors
(the convolution window, then the recurrent state), laid over the key pages then the
value pages of those block ids, in the cache's dtype.  The model reads it in float32
before a layer's ops and writes it back after them; a request's first chunk (nothing
computed before it) starts from zeros, whatever its pages held before.

Prefix caching (kv_cache/state_group.py): :func:`run_segmented` runs the state-carrying
core of a recurrent layer (its convolution and scan) for a step whose metadata lists
state checkpoints: it copies a prefix hit's checkpoint pages into the request's own
state pages first, and where a checkpoint is due inside a request's chunk it runs the
core over the chunk in segments ending there, copying the state pages into the
checkpoint's after each; the layer's projections run once over the whole step.
:func:`run_with_checkpoints` does the same for a layer's whole mixer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["StateLayout", "chunk_info", "run_segmented", "run_with_checkpoints"]


def chunk_info(meta: AttentionMetadata) -> tuple[torch.Tensor, bool]:
    """(has_state bool [num_seqs]: the sequence computed tokens before this chunk, decode:
    every sequence continues with exactly one token) of this step's metadata."""
    qsl = meta.query_start_loc
    qlen = qsl[1:] - qsl[:-1]
    has_state = (meta.seq_lens - qlen) > 0
    decode = bool(torch.all(qlen == 1)) and bool(torch.all(has_state))
    return has_state, decode


class StateLayout:
    """The state tensors of one recurrent layer (``shapes``: one per-request shape each,
    e.g. ``[(conv_dim, width - 1), (heads, dk, dv)]``) and how they lie in its pages."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        """Elements of one request's state."""
        return sum(self.sizes)

    def read(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, has_state: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each state tensor, float32 contiguous ``[num_seqs, *shape]`` (a copy): read from the pages
        (``pages``: int [num_seqs, num_pages], the group's block tables) where ``has_state``,
        zeros elsewhere (a page not written yet may hold anything, NaN included)."""
        k, v = kv_cache
        idx = pages.long()
        n = idx.shape[0]
        flat = torch.cat([k[idx].reshape(n, -1), v[idx].reshape(n, -1)], dim=1)[:, : self.numel].float()
        flat = torch.where(has_state.view(n, 1), flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
        # Contiguous: kernels update them in place through raw pointers.
        return [t.reshape(n, *s).contiguous() for t, s in zip(flat.split(self.sizes, dim=1), self.shapes)]

    def write(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> None:
        """Store ``states`` (as :meth:`read` returns them) into the pages, in the cache's dtype."""
        k, v = kv_cache
        idx = pages.long()
        n, num_pages = idx.shape
        page = math.prod(k.shape[1:])
        flat = torch.zeros(n, 2 * num_pages * page, dtype=k.dtype, device=k.device)
        flat[:, : self.numel] = torch.cat([s.reshape(n, -1) for s in states], dim=1).to(k.dtype)
        half = num_pages * page
        k[idx] = flat[:, :half].reshape(n, num_pages, *k.shape[1:])
        v[idx] = flat[:, half:].reshape(n, num_pages, *v.shape[1:])


def _copy_pages(kv_cache: tuple[torch.Tensor, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Pages ``dst`` of the layer's key and value tensors = pages ``src``."""
    if not src:
        return
    k, v = kv_cache
    s = torch.tensor(src, dtype=torch.int64, device=k.device)
    d = torch.tensor(dst, dtype=torch.int64, device=k.device)
    k.index_copy_(0, d, k.index_select(0, s))
    v.index_copy_(0, d, v.index_select(0, s))


def run_with_checkpoints(
    mixer: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
    h: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``mixer(h, meta)`` (a recurrent layer's whole forward over its state pages) with the
    step's state checkpoint work: :func:`run_segmented` with ``h`` as its one input."""
    return run_segmented(lambda xs, m: (mixer(xs[0], m),), (h,), kv_cache, meta)[0]


def run_segmented(
    core: Callable[[tuple[torch.Tensor, ...], AttentionMetadata], tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, ...],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, ...]:
    """``core(inputs, meta)`` (the state-carrying part of a recurrent layer: its convolution
    and scan over its state pages; ``inputs`` and the outputs are token-major, row ``t``
    of each belongs to token ``t``) with the step's state checkpoint work of the layer's
    group (``meta.state_copies`` and ``state_captures``): hits' checkpoints copied into
    their rows' state pages first; each capture's state, after its offset in the row's
    chunk, copied into its pages.

    A capture inside a chunk splits the core's run: round ``r`` runs the ``r``-th
    segment of every row that has one (metadata of those rows, their tokens, seq lens
    ending at the segment), so the row's state pages hold its state at each segment's
    end, exactly as if its chunk had ended there.  Only the core is segmented: a layer
    runs its per-token work (projections, gates, output norm and projection) once over
    the whole step, before and after."""
    copies, captures = meta.state_copies, meta.state_captures
    if not copies and not captures:
        return core(inputs, meta)
    tables = meta.block_tables.tolist()
    if copies:
        src = [p for _, pages in copies for p in pages]
        dst = [p for row, pages in copies for p in tables[row][: len(pages)]]
        _copy_pages(kv_cache, src, dst)
    qsl = meta.query_start_loc.tolist()
    num_seqs = len(qsl) - 1
    qlen = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    due: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for row, offset, pages in captures:
        due.setdefault((row, offset), []).append(pages)
    bounds = [[0] for _ in range(num_seqs)]
    for row, offset in sorted(due):
        if 0 < offset < qlen[row]:
            bounds[row].append(offset)
    for row in range(num_seqs):
        bounds[row].append(qlen[row])

    def capture(done: list[tuple[int, int]]) -> None:
        src, dst = [], []
        for row, offset in done:
            for pages in due.get((row, offset), ()):
                src += tables[row][: len(pages)]
                dst += pages
        _copy_pages(kv_cache, src, dst)

    rounds = max(len(b) for b in bounds) - 1
    if rounds == 1:
        outs = core(inputs, meta)
        capture([(row, qlen[row]) for row in range(num_seqs)])
        return outs
    num_tokens = inputs[0].shape[0]
    outs: list[torch.Tensor] | None = None
    seq_lens = meta.seq_lens.tolist()
    dev = meta.query_start_loc.device
    for r in range(rounds):
        rows = [i for i in range(num_seqs) if len(bounds[i]) > r + 1]
        idx = torch.cat(
            [torch.arange(qsl[i] + bounds[i][r], qsl[i] + bounds[i][r + 1], dtype=torch.int64) for i in rows]
        ).to(inputs[0].device)
        lens = [bounds[i][r + 1] - bounds[i][r] for i in rows]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        sub = replace(
            meta,
            positions=meta.positions.index_select(0, idx.to(meta.positions.device)),
            slot_mapping=meta.slot_mapping.index_select(0, idx.to(meta.slot_mapping.device)),
            block_tables=meta.block_tables[torch.tensor(rows, dtype=torch.int64, device=meta.block_tables.device)],
            seq_lens=torch.tensor(
                [seq_lens[i] - qlen[i] + bounds[i][r + 1] for i in rows], dtype=meta.seq_lens.dtype, device=dev
            ),
            query_start_loc=torch.tensor(starts, dtype=meta.query_start_loc.dtype, device=dev),
            state_copies=(),
            state_captures=(),
        )
        parts = core(tuple(x.index_select(0, idx) for x in inputs), sub)
        if outs is None:
            outs = [p.new_empty(num_tokens, *p.shape[1:]) for p in parts]
        for out, part in zip(outs, parts):
            out.index_copy_(0, idx, part)
        capture([(i, bounds[i][r + 1]) for i in rows])
    return tuple(outs)
