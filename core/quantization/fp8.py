"""FP8 e4m3 weights quantized at load, per-tensor or per-channel scales.

On GPUs with FP8 tensor cores (compute capability 8.9+) the matmul is native
(``torch._scaled_mm``, activations quantized per tensor on the fly; see
kernels/triton/quant_gpu.py); elsewhere it is emulated: the weight is stored in one byte
per value and dequantized to the activation dtype for each matmul.
"""

from __future__ import annotations

import torch

from pagedserve.quantization.base import QuantizedWeight
from pagedserve.quantization.int8 import _LoadTimeMethod

__all__ = ["Fp8Weight", "Fp8Method", "quantize_fp8"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (float8_e4m3fn ``[N, K]``, float32 scale ``[N]`` or ``[]``)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax()
    scale = amax.clamp_min(1e-12) / FP8_MAX
    s = scale[:, None] if per_channel else scale
    return (wf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Weight(QuantizedWeight):
    """qweight float8_e4m3fn ``[out, in]``; scale float32 ``[]`` (per tensor) or ``[out]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.qweight = qweight.contiguous()
        self.scale = scale.float()
        self.out_features, self.in_features = qweight.shape

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cuda":
            from pagedserve.kernels.triton.quant_gpu import fp8_scaled_mm, fp8_scaled_mm_supported

            if fp8_scaled_mm_supported(x.device):
                return fp8_scaled_mm(x, self.qweight, self.scale, bias)
        s = self.scale.to(x.dtype)
        w = self.qweight.to(x.dtype) * (s[:, None] if s.dim() == 1 else s)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.scale
        return (self.qweight.float() * (s[:, None] if s.dim() == 1 else s)).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def to(self, device: torch.device) -> Fp8Weight:
        return self if self.qweight.device == device else Fp8Weight(self.qweight.to(device), self.scale.to(device))

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        if any(p.scale.dim() == 0 for p in parts):
            # Per-tensor scales differ between q/k/v: widen to per-channel on fusion.
            scales = [p.scale.expand(p.out_features) if p.scale.dim() == 0 else p.scale for p in parts]
        else:
            scales = [p.scale for p in parts]
        return cls(torch.cat([p.qweight for p in parts]), torch.cat(scales))


class Fp8Method(_LoadTimeMethod):
    name = "fp8"
    description = "FP8 e4m3 weights, per-channel scales (native _scaled_mm on sm89+, emulated elsewhere)"

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        per_channel = self.config.get("per_channel", True)
        return Fp8Weight(*quantize_fp8(w, per_channel))

