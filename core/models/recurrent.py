"""Recurrent-layer state in the paged KV cache: read and write a layer's per-request state
through its KV cache group's state pages (pagedserve.kv_cache.state_group).

A recurrent layer (Gated DeltaNet, Mamba 2) is given the (key, value) tensors of its
group's slot like any layer; its group's block table lists, per request, the ``pages``
pages that hold its state.  The state is the concatenation of the layer's state tensors
(the convolution window, then the recurrent state), laid over the bytes of the key pages
then the value pages of those block ids, in the model's dtype whatever the cache's (an
8-bit cache's pages hold a bf16 or float32 state unchanged).  The model reads it in float32
before a layer's ops and writes it back after them; a request's first chunk (nothing
computed before it) starts from zeros, whatever its pages held before.

Prefix caching and speculative decoding (kv_cache/state_group.py): :func:`run_segmented`
runs the state-carrying core of a recurrent layer (its convolution and scan) over its
state, read from the pages once and written back once.  It copies a prefix hit's
checkpoint pages into the request's own state pages first, and where the step's
metadata wants the state at an offset inside a request's chunk (a checkpoint, or a
draft position) it runs the core over the chunk in segments ending there, writing the
state tensors into the capture's pages after each; the layer's projections run once
over the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["StateLayout", "chunk_info", "run_segmented"]


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
    e.g. ``[(conv_dim, width - 1), (heads, dk, dv)]``) and how they lie in its pages.

    ``dtype``: what the state is stored in (the model's dtype; None: the cache's).  The
    pages are taken as bytes, so a state of any dtype lies over a cache of any dtype: over
    an 8-bit cache (int8, fp8) a bf16 or float32 state keeps every bit, it only needs
    more pages (:meth:`nbytes` over a slot page's bytes)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype | None = None) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.dtype = dtype

    @property
    def numel(self) -> int:
        """Elements of one request's state."""
        return sum(self.sizes)

    def nbytes(self, cache_dtype: torch.dtype) -> int:
        """Bytes of one request's state in a cache of ``cache_dtype``."""
        return self.numel * (self.dtype or cache_dtype).itemsize

    def read(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, has_state: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each state tensor, float32 contiguous ``[num_seqs, *shape]`` (a copy): read from the pages
        (``pages``: int [num_seqs, num_pages], the group's block tables) where ``has_state``,
        zeros elsewhere (a page not written yet may hold anything, NaN included)."""
        k, v = (_bytes(t) for t in kv_cache)
        dtype = self.dtype or kv_cache[0].dtype
        idx = pages.long()
        n = idx.shape[0]
        raw = torch.cat([_row_bytes(k[idx], n), _row_bytes(v[idx], n)], dim=1)
        flat = raw[:, : self.numel * dtype.itemsize]
        if raw.shape[1] % dtype.itemsize:
            # Rows not a whole number of elements: no view of the slice; a fresh copy
            # (not .contiguous(), which keeps a single row's stride).
            flat = flat.clone(memory_format=torch.contiguous_format)
        flat = flat.view(dtype).float()
        flat = torch.where(has_state.view(n, 1), flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
        # Contiguous: kernels update them in place through raw pointers.
        return [t.reshape(n, *s).contiguous() for t, s in zip(flat.split(self.sizes, dim=1), self.shapes)]

    def write(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> None:
        """Store ``states`` (as :meth:`read` returns them) into the pages, in the state's dtype."""
        k, v = (_bytes(t) for t in kv_cache)
        dtype = self.dtype or kv_cache[0].dtype
        idx = pages.long()
        n, num_pages = idx.shape
        page = math.prod(k.shape[1:]) * k.element_size()
        flat = torch.zeros(n, 2 * num_pages * page, dtype=torch.uint8, device=k.device)
        state = torch.cat([s.reshape(n, -1) for s in states], dim=1).to(dtype)
        flat[:, : self.numel * dtype.itemsize] = state.view(torch.uint8)
        half = num_pages * page
        # (half is whole pages, so a whole number of the cache's elements: a view.)
        k[idx] = flat[:, :half].view(k.dtype).reshape(n, num_pages, *k.shape[1:])
        v[idx] = flat[:, half:].view(v.dtype).reshape(n, num_pages, *v.shape[1:])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache as its bytes (uint8: indexing and copies take them on every
    backend, fp8 included); a wider one as it is (viewed as bytes once gathered)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _row_bytes(pages: torch.Tensor, n: int) -> torch.Tensor:
    """Gathered pages ``[n, num_pages, ...]`` as one row of bytes per request."""
    return pages.reshape(n, -1).view(torch.uint8)


def _copy_pages(kv_cache: tuple[torch.Tensor, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Pages ``dst`` of the layer's key and value tensors = pages ``src``."""
    if not src:
        return
    k, v = (_bytes(t) for t in kv_cache)
    s = torch.tensor(src, dtype=torch.int64, device=k.device)
    d = torch.tensor(dst, dtype=torch.int64, device=k.device)
    k.index_copy_(0, d, k.index_select(0, s))
    v.index_copy_(0, d, v.index_select(0, s))


def run_segmented(
    core: Callable[[tuple[torch.Tensor, ...], AttentionMetadata, list[torch.Tensor]], tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, ...],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    layout: StateLayout,
) -> tuple[torch.Tensor, ...]:
    """``core(inputs, meta, states)`` (the state-carrying part of a recurrent layer: its
    convolution and scan; ``states``: its state tensors for ``meta``'s rows, as
    :meth:`StateLayout.read` returns them, which the core's ops update in place;
    ``inputs`` and the outputs are token-major, row ``t`` of each belongs to token
    ``t``) over the layer's state pages (``layout``), with the step's state work of the
    layer's group (``meta.state_copies`` and ``state_captures``): hits' checkpoints
    copied into their rows' state pages first; each capture's state, after its offset
    in the row's chunk, written into its pages (a prefix-cache checkpoint, or the state
    after a draft position that verification may keep: kv_cache/state_group.py).

    The state is read from the pages once and written back once.  A capture inside a
    chunk splits the core's run: round ``r`` runs the ``r``-th segment of every row that
    has one (metadata of those rows, their tokens, seq lens ending at the segment) on
    those rows' state tensors, exactly as if the row's chunk had ended there, and the
    captures at the segment's end are written from the tensors.  Only the core is
    segmented: a layer runs its per-token work (projections, gates, output norm and
    projection) once over the whole step, before and after."""
    copies, captures = meta.state_copies, meta.state_captures
    tables = meta.block_tables
    if copies:
        rows = tables.tolist()
        src = [p for _, pages in copies for p in pages]
        dst = [p for row, pages in copies for p in rows[row][: len(pages)]]
        _copy_pages(kv_cache, src, dst)
    has_state, _ = chunk_info(meta)
    states = layout.read(kv_cache, tables, has_state)
    if not captures:
        outs = core(inputs, meta, states)
        layout.write(kv_cache, tables, states)
        return outs
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

    def capture(done: list[tuple[int, int]], part: list[torch.Tensor], pos: dict[int, int]) -> None:
        """Write the states after ``done`` (row, offset) pairs, rows ``pos[row]`` of ``part``."""
        idx, pages = [], []
        for row, offset in done:
            for p in due.get((row, offset), ()):
                idx.append(pos[row])
                pages.append(p)
        if idx:
            sel = torch.tensor(idx, dtype=torch.int64, device=part[0].device)
            dst = torch.tensor(pages, dtype=torch.int64, device=kv_cache[0].device)
            layout.write(kv_cache, dst, [t.index_select(0, sel) for t in part])

    every = {i: i for i in range(num_seqs)}
    rounds = max(len(b) for b in bounds) - 1
    if rounds == 1:
        outs = core(inputs, meta, states)
        capture([(row, qlen[row]) for row in range(num_seqs)], states, every)
        layout.write(kv_cache, tables, states)
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
        row_idx = torch.tensor(rows, dtype=torch.int64, device=tables.device)
        sub = replace(
            meta,
            positions=meta.positions.index_select(0, idx.to(meta.positions.device)),
            slot_mapping=meta.slot_mapping.index_select(0, idx.to(meta.slot_mapping.device)),
            block_tables=tables[row_idx],
            seq_lens=torch.tensor(
                [seq_lens[i] - qlen[i] + bounds[i][r + 1] for i in rows], dtype=meta.seq_lens.dtype, device=dev
            ),
            query_start_loc=torch.tensor(starts, dtype=meta.query_start_loc.dtype, device=dev),
            state_copies=(),
            state_captures=(),
        )
        whole = len(rows) == num_seqs
        sel = row_idx.to(states[0].device)
        part = states if whole else [t.index_select(0, sel) for t in states]
        parts = core(tuple(x.index_select(0, idx) for x in inputs), sub, part)
        if not whole:
            for t, p in zip(states, part):
                t.index_copy_(0, sel, p)
        if outs is None:
            outs = [p.new_empty(num_tokens, *p.shape[1:]) for p in parts]
        for out, p in zip(outs, parts):
            out.index_copy_(0, idx, p)
        capture([(i, bounds[i][r + 1]) for i in rows], part, every if whole else {row: j for j, row in enumerate(rows)})
    layout.write(kv_cache, tables, states)
    return tuple(outs)
