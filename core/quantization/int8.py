"""INT8 weights quantized at load from a float checkpoint: weight-only (W8A16) and W8A8.

Both use symmetric per-output-channel weight scales (amax / 127).  W8A8 quantizes the
activations per token at run time (dynamic, symmetric, SmoothQuant's W8A8 without the
smoothing migration, which needs calibration data) and multiplies int8 by int8 with the
platform's integer matmul.  The matmuls are the op registry's ``int8_linear`` and
``w8a8_linear``, handed to the weights at load: the CPU platform registers
``torch._weight_int8pack_mm`` and ``torch._int_mm`` (oneDNN), the GPU platforms a
dequantize-to-the-activation-dtype matmul and a padded ``torch._int_mm``
(cuBLASLt/hipBLASLt); others keep the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedserve.kernels import reference
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight, is_linear_weight

__all__ = ["Int8Weight", "W8A8Weight", "Int8Method", "W8A8Method", "quantize_int8_per_channel"]


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``), symmetric per output row."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Weight(QuantizedWeight):
    """W8A16: qweight int8 ``[out, in]``, scale float32 ``[out]``.

    op: the ``int8_linear`` op to multiply with (the platform's); None: the reference.
    """

    #: The op a weight of this class multiplies with when none is handed to it.
    default_op: Callable = staticmethod(reference.int8_linear)

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, op: Callable | None = None) -> None:
        self.qweight = qweight.contiguous()
        self.scale = scale.float().contiguous()
        self.out_features, self.in_features = qweight.shape
        self.op = op or self.default_op

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, self.qweight, self.scale, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def to(self, device: torch.device) -> Int8Weight:
        if self.qweight.device == device:
            return self
        return type(self)(self.qweight.to(device), self.scale.to(device), self.op)

    def select_rows(self, rows: torch.Tensor) -> Int8Weight:
        q, s = _zero_row(self.qweight), _zero_row(self.scale)
        idx = rows.clamp(max=self.out_features)
        return type(self)(q.index_select(0, idx), s.index_select(0, idx), self.op)

    def select_columns(self, start: int, stop: int) -> Int8Weight:
        # Per-output-channel scales cover whole rows: each part of a row keeps its row's scale.
        return type(self)(self.qweight[:, start:stop], self.scale, self.op)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].op)


def _zero_row(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one zero row appended (the row that padding indices select)."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


class W8A8Weight(Int8Weight):
    """W8A8: as :class:`Int8Weight`, activations quantized per token on each call
    (by its ``w8a8_linear`` op)."""

    default_op = staticmethod(reference.w8a8_linear)


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
    required_ops = ("int8_linear",)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return Int8Weight(*quantize_int8_per_channel(w), op=self.ops.int8_linear)


class W8A8Method(_LoadTimeMethod):
    name = "w8a8"
    description = "INT8 weights (per channel) and activations (per token, dynamic), integer matmul"
    required_ops = ("w8a8_linear",)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return W8A8Weight(*quantize_int8_per_channel(w), op=self.ops.w8a8_linear)
