"""Which final hidden rows a step samples from, without gathers a decode step does not need."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["sample_index", "sampling_hidden"]


def sample_index(logits_indices: torch.Tensor, rows: list[int], scheduled: Sequence) -> torch.Tensor | None:
    """The hidden rows of the requests that sample this step, in batch order, or None
    when they are every row (every request samples its only token: a pure decode step).

    logits_indices int64 ``[num_seqs]`` (each scheduled request's last token); rows:
    indices into ``scheduled`` of the requests that sample.  Indexing a tensor with a
    Python list and the row copy cost ~5 us a step, every step.
    """
    if len(rows) == len(scheduled):
        if all(s.num_new_tokens == 1 for s in scheduled):
            return None
        return logits_indices
    return logits_indices[rows]


def sampling_hidden(
    hidden: torch.Tensor,
    logits_indices: torch.Tensor,
    rows: list[int],
    scheduled: Sequence,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The hidden rows of the requests that sample this step, in batch order.

    hidden ``[num_tokens, hidden_size]``; see :func:`sample_index`.  Returns
    ``[len(rows), hidden_size]``: ``hidden`` itself for a pure decode step, else a gather.
    """
    idx = sample_index(logits_indices, rows, scheduled)
    if idx is None and hidden.shape[0] == len(rows):
        return hidden
    idx = logits_indices if idx is None else idx
    return hidden.index_select(0, to_device(idx))
