"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept in their 32-value blocks.

The stored bytes of the .gguf file are the loaded format.  A weight multiplies through
the op registry's ``gguf_linear``, handed to it at load: the platforms choose the kernel
(the native CPU kernel of kernels/cpu/quant_gguf.cpp, Triton on CUDA/ROCm, the torch
reference elsewhere; see docs/quantization.md).  Once fused, each linear weight is put
through the registry's ``prepare_gguf_weight`` (``GGUFWeight.prepared``): the CPU
repacks the blocks for its tiled int8 GEMM there, in place of the file's blocks.  The
tied embedding of a GGUF model stays in blocks (rows are dequantized on lookup); its LM
head is a prepared copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.quant_reference import GGUF_TYPE_IDS
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight

__all__ = ["GGUFWeight", "GGUFMethod", "GGUF_KEPT_TYPES", "GGUF_TYPE_IDS"]

#: ggml types kept quantized; other types are dequantized at load as before.
GGUF_KEPT_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0")


class GGUFWeight(QuantizedWeight):
    """data: uint8 ``[out, in/32 * block_bytes]`` ggml blocks of type ``type_name``.

    op: the ``gguf_linear`` op to multiply with (the platform's, from its op registry);
        None means the torch reference.
    prepare: the same registry's ``prepare_gguf_weight`` (None: the blocks as they are).
    packed: what ``prepare`` returned for the blocks (set by :meth:`prepared`, which
        drops ``data``: None then); ``op`` multiplies with it.
    gated_op: the same registry's ``gguf_linear_silu_and_mul`` (None: ``op`` then the
        registry's ``silu_and_mul``), which a fused [gate; up] weight runs as a gated
        MLP's first half (:meth:`apply_silu_and_mul`).
    """

    # Every gguf_linear (the int8 kernels, the reference) sums in float32: as in llama.cpp,
    # a GGUF model's logits stay float32 rather than being rounded to a bfloat16 model's
    # 0.125 steps at logit magnitudes of 16-32, which made near-ties exact ties.
    float32_accumulation = True

    def __init__(
        self,
        type_name: str,
        data: torch.Tensor | None,
        in_features: int,
        op: Callable | None = None,
        prepare: Callable | None = None,
        packed: torch.Tensor | None = None,
        gated_op: Callable | None = None,
    ) -> None:
        if type_name not in GGUF_KEPT_TYPES:
            raise ValueError(f"GGUF type {type_name} is not kept quantized (supported: {', '.join(GGUF_KEPT_TYPES)})")
        if (data is None) == (packed is None):
            raise ValueError("a GGUFWeight holds either its blocks or their prepared form")
        if data is not None and (
            in_features % 32 or data.shape[1] != in_features // 32 * ref.GGUF_BLOCK_BYTES[type_name]
        ):
            raise ValueError(f"{type_name} rows of {data.shape[1]} bytes do not hold {in_features} values")
        self.type_name = type_name
        self.data = data
        self.out_features = data.shape[0] if data is not None else _out_features_of(packed, in_features, type_name)
        self.in_features = in_features
        self.op = op or reference.gguf_linear
        self.prepare = prepare
        self.packed = packed
        self.gated_op = gated_op

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, self.data if self.packed is None else self.packed, self.type_name, bias)

    def apply_silu_and_mul(self, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.gated_op is None:
            return silu_and_mul(self.apply(x, None))
        return self.gated_op(x, self.data if self.packed is None else self.packed, self.type_name, None)

    def prepared(self) -> GGUFWeight:
        """This weight with its blocks replaced by ``prepare(data)`` (the same bytes in the
        platform's own layout), or self without ``prepare``, when already prepared or when
        the op takes the blocks as they are.  A prepared weight only multiplies: its
        blocks are gone (a tied LM head's copy is prepared, the embedding keeps its blocks)."""
        if self.prepare is None or self.packed is not None:
            return self
        packed = self.prepare(self.data, self.type_name)
        if packed is self.data:
            return self
        return GGUFWeight(self.type_name, None, self.in_features, self.op, self.prepare, packed, self.gated_op)

    def _blocks(self) -> torch.Tensor:
        if self.data is None:
            raise ValueError(
                f"this {self.type_name} weight was repacked at load for its platform's gguf_linear: "
                "its blocks are no longer held (use the weight before prepared())"
            )
        return self.data

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` int64 ``[n]`` dequantized -> ``[n, in]`` dtype (an embedding lookup)."""
        return ref.dequantize_gguf(self._blocks().index_select(0, ids), self.type_name).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ref.dequantize_gguf(self._blocks(), self.type_name).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data if self.packed is None else self.packed]

    def to(self, device: torch.device) -> GGUFWeight:
        if self.tensors()[0].device == device:
            return self
        # A prepared form belongs to its platform: only the blocks move.
        return GGUFWeight(
            self.type_name, self._blocks().to(device), self.in_features, self.op, self.prepare, gated_op=self.gated_op
        )

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        first = parts[0]
        if all(isinstance(p, GGUFWeight) and p.type_name == first.type_name for p in parts):
            data = torch.cat([p._blocks() for p in parts])
            return GGUFWeight(
                first.type_name, data, first.in_features, first.op, first.prepare, gated_op=first.gated_op
            )
        # Mixed block types (some llama.cpp mixes use Q8_0 for v_proj): keep them apart.
        return StackedWeight(parts)


def _out_features_of(packed: torch.Tensor, in_features: int, type_name: str) -> int:
    """Output rows of a prepared weight: its bytes over the bytes of one row of blocks
    (a platform's layout holds the file's bytes, in its own order)."""
    return packed.numel() // (in_features // 32 * ref.GGUF_BLOCK_BYTES[type_name])


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

    def prepared(self) -> StackedWeight:
        return StackedWeight([p.prepared() for p in self.parts])

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
    required_ops = ("gguf_linear",)

    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        gguf = getattr(source, "_gguf", None)
        if gguf is None:
            raise ValueError(f"quantization='gguf' needs a .gguf file; {source.path} is a Hugging Face folder")
        op, prepare = self.ops.gguf_linear, self.ops.prepare_gguf_weight
        gated = self.ops.gguf_linear_silu_and_mul
        for name, t in gguf.weights(keep_quantized=GGUF_KEPT_TYPES):
            if isinstance(t, torch.Tensor):
                yield name, t
            else:
                yield name, GGUFWeight(t.type_name, t.data, t.shape[1], op, prepare, gated_op=gated)
