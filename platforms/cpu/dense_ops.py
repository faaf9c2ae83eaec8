"""The CPU platform's dense linear layers: weights pre-packed once for oneDNN.

torch's CPU ``linear`` hands a plain ``[out, in]`` bf16 weight to oneDNN, which
reorders it into its blocked layout on every call: for a decode step that is a second
pass over all the weights.  ``prepare_linear_weight`` does the reorder once at load
(``torch.ops.mkldnn._reorder_linear_weight``) and ``linear`` feeds the packed weight to
``torch.ops.mkldnn._linear_pointwise``.  The arithmetic is oneDNN's either way: outputs
are bit-identical to ``torch.nn.functional.linear``.  Measured on the default model's
layers (benchmarks/cpu_kernels.py --linear, docs/benchmarks.md): 1.3-1.8x at decode
batch sizes, about equal at prefill sizes.

``PAGEDSERVE_CPU_PREPACK=0`` keeps plain weights.  Plain weights still go through the
native skinny kernel for a few bf16 rows where it is built (kernels/cpu/linear.h).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagedserve.kernels import reference

__all__ = ["PREPACK_DTYPES", "prepack_enabled", "prepare_linear_weight", "make_linear"]

#: Weight dtypes packed: bf16 is the CPU's compute dtype where it has native bf16.
PREPACK_DTYPES = (torch.bfloat16,)


def prepack_enabled() -> bool:
    """Whether weights are packed: oneDNN is in this torch and PAGEDSERVE_CPU_PREPACK is not 0."""
    off = os.environ.get("PAGEDSERVE_CPU_PREPACK", "1").strip().lower() in ("0", "false", "no", "off")
    return not off and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """See reference.prepare_linear_weight: a bf16 CPU weight -> oneDNN's packed layout
    (an opaque ``torch._mkldnn`` tensor); anything else unchanged."""
    if (weight.dtype not in PREPACK_DTYPES or weight.dim() != 2 or weight.device.type != "cpu"
            or weight.is_mkldnn or weight.numel() == 0):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def make_linear(plain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``linear`` that runs packed weights through oneDNN and plain ones through ``plain``."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See reference.linear; ``weight`` may be packed by ``prepare_linear_weight``."""
        if not weight.is_mkldnn:
            return plain(x, weight, bias)
        if x.dtype != weight.dtype or x.device.type != "cpu" or (bias is not None and bias.dtype != x.dtype):
            return reference.linear(x, weight.to_dense().to(x.dtype), None if bias is None else bias.to(x.dtype))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return linear
