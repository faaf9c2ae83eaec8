"""Pure-torch specification of the batched multi-LoRA op (Punica-style SGMV).

One batch mixes rows of several adapters: every row ``i`` carries a slot index
``token_slots[i]`` into stacked adapter weights (``-1``: the base model, no delta).
Rows are grouped by slot and each group gets one shrink (``x @ A.T``) and one expand
(``@ B.T``) matmul, so the cost is two small GEMMs per adapter in the batch, never
one per row.
"""

from __future__ import annotations

import torch

__all__ = ["lora_linear"]


def lora_linear(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Add each row's adapter delta to ``y`` in place and return ``y``.

    y: [num_tokens, out] (may be a strided view, e.g. a column slice of a fused output);
    x: [num_tokens, in]; lora_a: [num_slots, rank, in]; lora_b: [num_slots, out, rank]
    (the adapter's scaling already folded in; ranks below ``rank`` are zero-padded);
    token_slots: int64 [num_tokens], each in ``[-1, num_slots)``.

    ``y[i] += lora_b[s] @ (lora_a[s] @ x[i])`` for every row with ``s = token_slots[i] >= 0``,
    computed in float32 and added in ``y``'s dtype; rows with ``s == -1`` are untouched.
    """
    slots = token_slots.tolist() if token_slots.numel() else []
    for s in sorted(set(slots) - {-1}):
        rows = (token_slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, rows).float()
        delta = (xs @ lora_a[s].float().T) @ lora_b[s].float().T
        y.index_add_(0, rows, delta.to(y.dtype))
    return y
