"""The one op hello overrides.  It must match ``pagedserve.kernels.reference.silu_and_mul``."""

from __future__ import annotations

import torch

__all__ = ["silu_and_mul"]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = cat(gate, up); returns silu(gate) * up, [..., d], in x's dtype.

    Written out as gate * sigmoid(gate) * up (computed in float32) rather than calling
    torch's silu, so that the reference test compares two independent formulas.
    """
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)
