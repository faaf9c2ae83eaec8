"""GPU-only quantized matmuls that torch provides natively (no Triton code): FP8 through
``torch._scaled_mm`` on Hopper-class GPUs.

Reference: :func:`pagedserve.kernels.quant_reference.fp8_linear` (with the activations
also rounded to e4m3 per token here, the only extra error).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["fp8_scaled_mm_supported", "fp8_scaled_mm"]

FP8_MAX = 448.0


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_scaled_mm_supported(device: torch.device) -> bool:
    """Row-wise scaled FP8 GEMMs need NVIDIA compute capability 9.0+ (not ROCm's fnuz types)."""
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch, "_scaled_mm"):
        return False
    return _capability(device.index or 0) >= (9, 0)


def fp8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x ``[M, K]`` @ (qweight float8_e4m3fn ``[N, K]`` * scale ``[]``/``[N]``)^T -> ``[M, N]`` x.dtype.

    Activations are quantized per token (dynamic); M is padded to a multiple of 16.
    """
    m, n = x.shape[0], qweight.shape[0]
    xf = x.float()
    xs = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    xq = (xf / xs).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    pad = -m % 16
    if pad:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        xs = torch.nn.functional.pad(xs, (0, 0, 0, pad), value=1.0)
    ws = scale.float().expand(n).reshape(1, n).contiguous()
    y = torch._scaled_mm(xq, qweight.t(), scale_a=xs.contiguous(), scale_b=ws, out_dtype=torch.bfloat16)[:m]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
