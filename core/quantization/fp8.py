"""FP8 e4m3 weights quantized at load, per-tensor or per-channel scales.

The matmul is the op registry's ``fp8_linear``, handed to the weights at load.  The
CUDA platform's runs ``torch._scaled_mm`` on GPUs with row-wise scaled FP8 GEMMs
(compute capability 9.0+; activations quantized per token on the fly, see
kernels/triton/quant_gpu.py); elsewhere FP8 is emulated: the weight is stored in one
byte per value and dequantized for each matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels import reference
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
    """qweight float8_e4m3fn ``[out, in]``; scale float32 ``[]`` (per tensor) or ``[out]``.

    op: the ``fp8_linear`` op to multiply with (the platform's); None: the reference.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, op: Callable | None = None) -> None:
        self.qweight = qweight.contiguous()
        self.scale = scale.float()
        self.out_features, self.in_features = qweight.shape
        self.op = op or reference.fp8_linear

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, self.qweight, self.scale, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.scale
        return (self.qweight.float() * (s[:, None] if s.dim() == 1 else s)).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def to(self, device: torch.device) -> Fp8Weight:
        if self.qweight.device == device:
            return self
        return Fp8Weight(self.qweight.to(device), self.scale.to(device), self.op)

    def select_rows(self, rows: torch.Tensor) -> Fp8Weight:
        idx = rows.clamp(max=self.out_features)
        q = torch.cat([self.qweight, self.qweight.new_zeros(1, self.in_features)]).index_select(0, idx)
        s = self.scale
        if s.dim() == 1:
            s = torch.cat([s, s.new_zeros(1)]).index_select(0, idx)
        return Fp8Weight(q, s, self.op)

    def select_columns(self, start: int, stop: int) -> Fp8Weight:
        # A per-tensor or per-output-channel scale covers each part of a row.
        return Fp8Weight(self.qweight[:, start:stop], self.scale, self.op)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        if any(p.scale.dim() == 0 for p in parts):
            # Per-tensor scales differ between q/k/v: widen to per-channel on fusion.
            scales = [p.scale.expand(p.out_features) if p.scale.dim() == 0 else p.scale for p in parts]
        else:
            scales = [p.scale for p in parts]
        return cls(torch.cat([p.qweight for p in parts]), torch.cat(scales), parts[0].op)


class Fp8Method(_LoadTimeMethod):
    name = "fp8"
    description = "FP8 e4m3 weights, per-channel scales (native _scaled_mm on sm90+, emulated elsewhere)"
    required_ops = ("fp8_linear",)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        per_channel = self.config.get("per_channel", True)
        return Fp8Weight(*quantize_fp8(w, per_channel), op=self.ops.fp8_linear)
