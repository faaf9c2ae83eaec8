"""INT8 weights quantized at load from a float checkpoint: weight-only (W8A16) and W8A8.

Both use symmetric per-output-channel weight scales (amax / 127).  W8A8 quantizes the
activations per token at run time (dynamic, symmetric, SmoothQuant's W8A8 without the
smoothing migration, which needs calibration data) and multiplies int8 by int8 with the
platform's integer matmul: ``torch._int_mm`` (oneDNN VNNI on CPUs, cuBLASLt/hipBLASLt on
GPUs).  W8A16 uses ``torch._weight_int8pack_mm`` where torch has it (CPU), otherwise it
dequantizes to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight, is_linear_weight

__all__ = ["Int8Weight", "W8A8Weight", "Int8Method", "W8A8Method", "quantize_int8_per_channel"]


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``), symmetric per output row."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Weight(QuantizedWeight):
    """W8A16: qweight int8 ``[out, in]``, scale float32 ``[out]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.qweight = qweight.contiguous()
        self.scale = scale.float().contiguous()
        self.out_features, self.in_features = qweight.shape

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32):
            # aten's CPU int8 weight-only kernel: scales applied per output channel.
            y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale.to(x.dtype))
            return y if bias is None else y + bias.to(y.dtype)
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def to(self, device: torch.device) -> Int8Weight:
        return self if self.qweight.device == device else type(self)(self.qweight.to(device), self.scale.to(device))

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]))


class W8A8Weight(Int8Weight):
    """W8A8: as :class:`Int8Weight`, activations quantized per token on each call."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(qweight, scale)
        # _int_mm wants the right operand [K, N]; a transposed view of [N, K] rows is what
        # oneDNN reads fastest (checked with benchmarks/quantization.py).
        self.qweight_t = self.qweight.t()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xq, xs = ref.quantize_per_token_int8(x)
        m = xq.shape[0]
        if x.device.type != "cpu" and m <= 16:
            # cuBLASLt's int8 GEMM needs more than 16 rows: pad (decode batches are small).
            xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - m))
        acc = torch._int_mm(xq, self.qweight_t)[:m]
        y = acc.float() * xs * self.scale[None, :]
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)


class _LoadTimeMethod(QuantizationMethod):
    """Quantizes the linear weights of a float checkpoint as they stream in."""

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        raise NotImplementedError

    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        for name, t in source.plain_weights():
            yield name, (self.quantize(t) if is_linear_weight(name) else t)


class Int8Method(_LoadTimeMethod):
    name = "int8"
    description = "INT8 weight-only (W8A16), per-channel scales, quantized at load"

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return Int8Weight(*quantize_int8_per_channel(w))


class W8A8Method(_LoadTimeMethod):
    name = "w8a8"
    description = "INT8 weights (per channel) and activations (per token, dynamic), integer matmul"

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return W8A8Weight(*quantize_int8_per_channel(w))
