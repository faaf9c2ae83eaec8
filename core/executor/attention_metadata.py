"""AttentionMetadata: the per-step attention inputs the executor builds once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer.

    positions: int64 [num_tokens]; slot_mapping: int64 [num_tokens]
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs]
    query_start_loc: int32 [num_seqs + 1]

    With KV cache groups (pagedserve.kv_cache.kv_groups) ``block_tables`` and
    ``slot_mapping`` are the first group's; ``groups`` holds every group's metadata and
    ``layer_groups`` each model layer's group, and :meth:`for_layer` picks a layer's.

    ``key_ends`` (int32 [num_tokens], or None): where a query token sees keys up to a
    later position than its own (``paged_attention``'s ``key_ends``: the tokens of a
    span attending to each other both ways, Gemma 3's images); None: causal.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    #: Per model layer its KV cache group (None: one group, every layer uses this one).
    layer_groups: tuple[int, ...] | None = None
    groups: list[AttentionMetadata] = field(default_factory=list, repr=False)
    key_ends: torch.Tensor | None = None
    #: A recurrent-state group's checkpoint work this step (None: none): ``copies``
    #: (row, checkpoint page ids) to copy into that row's state pages before its chunk,
    #: ``captures`` (row, offset in its chunk, page ids) to write its state into after
    #: that many of its tokens (kv_cache/state_group.py; models/recurrent.py runs them).
    state_copies: tuple[tuple[int, tuple[int, ...]], ...] = ()
    state_captures: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata of model layer ``layer``: its group's block tables and slots."""
        if self.layer_groups is None:
            return self
        return self.groups[self.layer_groups[layer]]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """The same metadata with ``fn`` applied to every tensor (a device move)."""
        moved = AttentionMetadata(*(fn(getattr(self, f.name)) for f in fields(self)[:5]))
        if self.key_ends is not None:
            moved.key_ends = fn(self.key_ends)
        if self.layer_groups is None:
            return moved
        groups = [
            replace(
                moved,
                block_tables=fn(g.block_tables),
                slot_mapping=fn(g.slot_mapping),
                state_copies=g.state_copies,
                state_captures=g.state_captures,
            )
            for g in self.groups
        ]
        return replace(moved, layer_groups=self.layer_groups, groups=groups)
