"""AttentionMetadata: the per-step attention inputs the executor builds once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer.

    positions: int64 [num_tokens]; slot_mapping: int64 [num_tokens]
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs]
    query_start_loc: int32 [num_seqs + 1]
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """The same metadata with ``fn`` applied to every tensor (a device move)."""
        return AttentionMetadata(*(fn(getattr(self, f.name)) for f in fields(self)))
