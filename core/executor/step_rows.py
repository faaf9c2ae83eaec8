"""Which final hidden rows a step samples from, without gathers a decode step does not need."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["sampling_hidden"]


def sampling_hidden(
    hidden: torch.Tensor,
    logits_indices: torch.Tensor,
    rows: list[int],
    scheduled: Sequence,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The hidden rows of the requests that sample this step, in batch order.

    hidden ``[num_tokens, hidden_size]``; logits_indices int64 ``[num_seqs]`` (each
    scheduled request's last token); rows: indices into ``scheduled`` of the requests
    that sample.  Returns ``[len(rows), hidden_size]``: ``hidden`` itself when every
    request samples its only token (a pure decode step), else a gather.  Indexing a
    tensor with a Python list and the row copy cost ~5 us a step, every step.
    """
    if len(rows) == len(scheduled):
        if hidden.shape[0] == len(rows) and all(s.num_new_tokens == 1 for s in scheduled):
            return hidden
        idx = logits_indices
    else:
        idx = logits_indices[rows]
    return hidden.index_select(0, to_device(idx))
