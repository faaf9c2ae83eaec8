"""The CPU platform's dense linear layers: weights packed once at load.

A decode step multiplies a few dozen activation rows by every weight of the model, so
how the weights are laid out decides its speed.  ``prepare_linear_weight`` runs once
per dense weight at load and ``linear`` reads what it returned:

- **native packed** (AVX-512 BF16 builds of the native kernels, ``N % 16 == 0`` and
  ``K % 2 == 0``): the weight becomes ``[N/16, K/2, 16, 2]`` bf16, VNNI pairs for the
  packed kernel of kernels/cpu/linear.h.  Measured on the default model's layers
  against oneDNN with its own packing (benchmarks/cpu_kernels.py --linear,
  docs/kernels_cpu.md): 1.6x at 1 row, 1.2-1.4x at 4-64 rows, 1.1x at 256, equal at 2048.
- **oneDNN packed** otherwise (torch's oneDNN, ``torch.ops.mkldnn``): torch's CPU
  ``linear`` hands oneDNN a plain ``[out, in]`` weight, which oneDNN reorders into its
  blocked layout on every call; ``_reorder_linear_weight`` does that once, and
  ``_linear_pointwise`` takes the result.  Outputs bit-identical to
  ``torch.nn.functional.linear``.

This is the static order, used with ``PAGEDSERVE_CPU_TUNE=0``; by default the layouts
and kernels are chosen by timing them on this machine (platforms/cpu/tuned_linear.py),
falling back to the functions here for weights and inputs the tuner does not route.

``PAGEDSERVE_CPU_PREPACK=0`` keeps plain weights (which still go through the native
skinny kernel for a few bf16 rows where it is built).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels import reference
from pagedserve.platforms.options import CpuOptions

__all__ = [
    "PREPACK_DTYPES",
    "onednn_available",
    "prepack_enabled",
    "prepare_linear_weight",
    "make_prepare_linear_weight",
    "make_linear",
    "make_linear_silu_and_mul",
]

#: Weight dtypes packed: bf16 is the CPU's compute dtype where it has native bf16.
PREPACK_DTYPES = (torch.bfloat16,)


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its weight packing."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack_enabled(options: CpuOptions | None = None) -> bool:
    """Whether weights are packed for oneDNN: requested (PAGEDSERVE_CPU_PREPACK, in
    ``options``; None: the environment now) and available."""
    return (CpuOptions.from_env() if options is None else options).prepack and onednn_available()


def prepare_linear_weight(weight: torch.Tensor, native=None) -> torch.Tensor:
    """See reference.prepare_linear_weight: a bf16 CPU weight -> the native packed layout
    (``native``: the loaded NativeCpuKernels, when it has the packed kernel and the
    shape fits), else oneDNN's packed layout (an opaque ``torch._mkldnn`` tensor);
    anything else unchanged."""
    if (
        weight.dtype not in PREPACK_DTYPES
        or weight.dim() != 2
        or weight.device.type != "cpu"
        or weight.is_mkldnn
        or weight.numel() == 0
    ):
        return weight
    if native is not None:
        packed = native.pack_linear_weight(weight)
        if packed is not None:
            return packed
    if onednn_available():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return weight


def make_prepare_linear_weight(native=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``prepare_linear_weight`` bound to ``native`` (None: oneDNN packing only)."""

    def prepare(weight: torch.Tensor) -> torch.Tensor:
        """See reference.prepare_linear_weight (dense_ops.prepare_linear_weight)."""
        return prepare_linear_weight(weight, native)

    return prepare


def make_linear(plain: Callable[..., torch.Tensor], native=None) -> Callable[..., torch.Tensor]:
    """``linear`` that runs natively packed weights (4-D) through ``native``'s packed
    kernel, oneDNN-packed ones through oneDNN and plain ones through ``plain``."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See reference.linear; ``weight`` may be packed by ``prepare_linear_weight``."""
        if weight.dim() == 4:
            return native.packed_linear(x, weight, bias)
        if not weight.is_mkldnn:
            return plain(x, weight, bias)
        if x.dtype != weight.dtype or x.device.type != "cpu" or (bias is not None and bias.dtype != x.dtype):
            return reference.linear(x, weight.to_dense().to(x.dtype), None if bias is None else bias.to(x.dtype))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return linear


def make_linear_silu_and_mul(
    linear: Callable[..., torch.Tensor], silu_and_mul: Callable[[torch.Tensor], torch.Tensor], native
) -> Callable[..., torch.Tensor]:
    """``linear_silu_and_mul`` that runs natively packed [gate; up] weights through
    ``native``'s gated packed kernel (the 2*d product never written) and anything else
    through ``silu_and_mul(linear(...))`` of the registry."""

    def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See reference.linear_silu_and_mul; ``weight`` may be packed by ``prepare_linear_weight``."""
        if weight.dim() == 4:
            return native.packed_linear_silu_and_mul(x, weight, bias)
        return silu_and_mul(linear(x, weight, bias))

    return linear_silu_and_mul
