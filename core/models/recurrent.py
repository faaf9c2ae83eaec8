"""Recurrent-layer state in the paged KV cache: read and write a layer's per-request state
through its KV cache group's state pages (pagedserve.kv_cache.state_group).

A recurrent layer (Gated DeltaNet, Mamba 2) is given the (key, value) tensors of its
group's slot like any layer; its group's block table lists, per request, the ``pages``
pages that hold its state.  The state is the concatenation of the layer's state tensors
(the convolution window, then the recurrent state), laid over the key pages then the
value pages of those block ids, in the cache's dtype.  The model reads it in float32
before a layer's ops and writes it back after them; a request's first chunk (nothing
computed before it) starts from zeros, whatever its pages held before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["StateLayout", "chunk_info"]


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
