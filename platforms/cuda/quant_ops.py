"""Quantized linear ops of the GPU platforms (cuda and rocm; contracts in
pagedserve.kernels.reference).

- ``gguf_linear``: the Triton kernel (kernels/triton/quant_gguf.py), registered with the
  other Triton kernels (platforms/cuda/ops.py).
- ``int8_linear``: the weight dequantized to x's dtype, one dense matmul.
- ``w8a8_linear``: ``torch._int_mm`` (cuBLASLt/hipBLASLt), x padded past 16 rows.
- ``fp8_linear``: on cuda, ``torch._scaled_mm`` where the GPU has row-wise scaled FP8
  GEMMs (compute capability 9.0+, checked per device), emulated otherwise; on rocm,
  emulated (the weight dequantized to x's dtype).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import quant_reference as qref
from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_gpu_quant_ops", "w8a8_linear", "fp8_linear_scaled_mm"]

#: cuBLASLt's int8 GEMM needs more rows than this; smaller x are padded.
INT_MM_MIN_ROWS = 17


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference.w8a8_linear`` with the integer products in ``torch._int_mm``."""
    xq, xs = qref.quantize_per_token_int8(x)
    m = xq.shape[0]
    if m < INT_MM_MIN_ROWS:  # decode batches are small: pad rather than fall back
        xq = torch.nn.functional.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(xq, qweight.t())[:m]
    y = acc.float() * xs * scale.float()[None, :]
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def fp8_linear_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference.fp8_linear`` through ``torch._scaled_mm`` (activations quantized to e4m3
    per row) where the device supports it, else emulated."""
    from pagedserve.kernels.triton.quant_gpu import fp8_scaled_mm, fp8_scaled_mm_supported

    if x.dim() == 2 and fp8_scaled_mm_supported(x.device):
        return fp8_scaled_mm(x, qweight, scale, bias)
    return qref.fp8_linear_dense(x, qweight, scale, bias)


def register_gpu_quant_ops(ops: OpRegistry, *, fp8_scaled_mm: bool) -> None:
    """Install the torch-provided quantized ops (``gguf_linear`` comes with Triton).

    fp8_scaled_mm: use ``torch._scaled_mm`` for FP8 where the device supports it
        (NVIDIA only: ROCm's FP8 GEMMs take the fnuz e4m3 variant).
    """
    ops.register("int8_linear", qref.int8_linear_dense, source="torch")
    ops.register("w8a8_linear", w8a8_linear, source="torch")
    ops.register("fp8_linear", fp8_linear_scaled_mm if fp8_scaled_mm else qref.fp8_linear_dense, source="torch")
