"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept in their 32-value blocks.

The stored bytes of the .gguf file are the in-memory format (no repacking), so the
default model's weights take their file size.  Kernels: the native CPU kernel
(kernels/cpu/quant_gguf.cpp: int8 activations, VNNI/AVX2 dot products), the Triton
kernel on CUDA/ROCm (kernels/triton/quant_gguf.py), the torch reference elsewhere.
The tied embedding of a GGUF model stays in blocks too: rows are dequantized on lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight

__all__ = ["GGUFWeight", "GGUFMethod", "GGUF_KEPT_TYPES", "GGUF_TYPE_IDS"]

#: ggml types kept quantized; other types are dequantized at load as before.
GGUF_KEPT_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0")
GGUF_TYPE_IDS: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
#: Rows of x above which the CPU dequantizes the weight to bf16/fp32 and uses the dense
#: matmul instead of the int8 dot-product kernel (prefill); set from benchmarks/quantization.py.
CPU_DENSE_MIN_ROWS = 128


def _cpu_kernel() -> Callable | None:
    from pagedserve.quantization.native import load_quant_kernels

    module = load_quant_kernels()
    return None if module is None else module.gguf_linear


class GGUFWeight(QuantizedWeight):
    """data: uint8 ``[out, in/32 * block_bytes]`` ggml blocks of type ``type_name``."""

    def __init__(self, type_name: str, data: torch.Tensor, in_features: int, kernel: str = "reference") -> None:
        if type_name not in GGUF_KEPT_TYPES:
            raise ValueError(f"GGUF type {type_name} is not kept quantized (supported: {', '.join(GGUF_KEPT_TYPES)})")
        if in_features % 32 or data.shape[1] != in_features // 32 * ref.GGUF_BLOCK_BYTES[type_name]:
            raise ValueError(f"{type_name} rows of {data.shape[1]} bytes do not hold {in_features} values")
        self.type_name = type_name
        self.data = data
        self.out_features = data.shape[0]
        self.in_features = in_features
        self.kernel = kernel
        self._fn = _cpu_kernel() if kernel == "cpu" else None
        if kernel == "triton":
            from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton

            self._fn = gguf_linear_triton

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel == "cpu" and self._fn is not None and x.dtype in (torch.float32, torch.bfloat16):
            if x.shape[0] >= CPU_DENSE_MIN_ROWS:
                return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)
            y = self._fn(x, self.data, GGUF_TYPE_IDS[self.type_name])
            if bias is not None:
                y += bias.float()
            return y.to(x.dtype)
        if self.kernel == "triton" and self._fn is not None:
            return self._fn(x, self.data, self.type_name, bias)
        return ref.gguf_linear(x, self.data, self.type_name, bias)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` int64 ``[n]`` dequantized -> ``[n, in]`` dtype (an embedding lookup)."""
        return ref.dequantize_gguf(self.data.index_select(0, ids), self.type_name).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ref.dequantize_gguf(self.data, self.type_name).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def to(self, device: torch.device) -> GGUFWeight:
        if self.data.device == device:
            return self
        return GGUFWeight(self.type_name, self.data.to(device), self.in_features, self.kernel)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        first = parts[0]
        if all(isinstance(p, GGUFWeight) and p.type_name == first.type_name for p in parts):
            return GGUFWeight(first.type_name, torch.cat([p.data for p in parts]), first.in_features, first.kernel)
        # Mixed block types (some llama.cpp mixes use Q8_0 for v_proj): keep them apart.
        return StackedWeight(parts)


class StackedWeight(QuantizedWeight):
    """Several weights with one input, outputs concatenated (for fusions of mixed types)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p.apply(x) for p in self.parts], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]

    def to(self, device: torch.device) -> StackedWeight:
        return StackedWeight([p.to(device) for p in self.parts])

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        return StackedWeight(parts)


class GGUFMethod(QuantizationMethod):
    """``quantization="gguf"``: Q4_0/Q4_1/Q8_0 tensors of a .gguf stay in blocks (linear
    layers, the embedding and an untied LM head); other types are dequantized at load."""

    name = "gguf"
    description = "GGUF Q4_0/Q4_1/Q8_0 blocks kept quantized"

    def kernel(self) -> str:
        if self.platform_name == "cpu":
            return "cpu"
        if self.platform_name in ("cuda", "rocm"):
            return "triton"
        return "reference"

    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        gguf = getattr(source, "_gguf", None)
        if gguf is None:
            raise ValueError(f"quantization='gguf' needs a .gguf file; {source.path} is a Hugging Face folder")
        kernel = self.kernel()
        for name, t in gguf.weights(keep_quantized=GGUF_KEPT_TYPES):
            if isinstance(t, torch.Tensor):
                yield name, t
            else:
                yield name, GGUFWeight(t.type_name, t.data, t.shape[1], kernel)
