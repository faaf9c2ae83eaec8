"""Quantized linear weights and quantization methods: the contracts and the registry.

A :class:`QuantizedWeight` stands where the model keeps a float ``[out, in]`` linear
weight; model code calls ``weight.apply(x, bias)`` instead of ``ops.linear``.  A
:class:`QuantizationMethod` turns a checkpoint's weight stream into such weights (keeping
stored quantized tensors, or quantizing float ones at load) and hands each weight the
op of the platform's op registry that multiplies in its format (``ops.gguf_linear``,
``ops.fp8_linear``, ...): which kernel runs is the platform's choice, made once when
its ops are registered, never here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

__all__ = ["QuantizedWeight", "QuantizationMethod", "LINEAR_SUFFIXES", "is_linear_weight"]

#: Checkpoint names of the linear layers a method may quantize (norms and embeddings
#: stay): the Llama-style projections (Qwen MoE experts' too), the checkpoint-fused ones
#: of Phi-3 and GLM-4, StarCoder2's MLP, Mixtral's experts (w1, w3 gate/up; w2 down) and
#: DeepSeek-V2's latent-attention projections.
LINEAR_SUFFIXES: tuple[str, ...] = tuple(
    f"{m}.weight"
    for m in (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "qkv_proj",
        "gate_up_proj",
        "c_fc",
        "c_proj",
        "w1",
        "w2",
        "w3",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    )
)


def is_linear_weight(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(LINEAR_SUFFIXES)


class QuantizedWeight(ABC):
    """A linear weight of logical shape ``[out_features, in_features]`` kept quantized."""

    out_features: int
    in_features: int
    #: Whether ``apply`` accumulates in float32 whatever x's dtype (only its result is
    #: rounded to x.dtype): an LM head given float32 activations then returns its logits
    #: unrounded at no extra cost, which ``DecoderModel.compute_logits`` does.  Such a
    #: weight's ``apply`` also takes ``out_dtype`` (None: x's dtype), float32 returning its
    #: sums unrounded from bf16 activations (a projection into a float32 residual stream).
    float32_accumulation: ClassVar[bool] = False

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[M, in]`` (float32 / bfloat16) -> ``[M, out]`` in x.dtype."""

    def apply_silu_and_mul(self, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A gated MLP's first half on this [gate; up] weight: x ``[M, in]`` ->
        ``silu_and_mul(apply(x))`` ``[M, out/2]`` (``silu_and_mul``: the registry's op).
        A format whose registry has a fused op for it (GGUF) uses that instead."""
        return silu_and_mul(self.apply(x, None))

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` this stands for."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for memory accounting and device moves)."""

    @abstractmethod
    def to(self, device: torch.device) -> QuantizedWeight:
        """A copy on ``device`` (self when already there)."""

    @classmethod
    @abstractmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights along the output dimension (fused q/k/v and gate/up)."""

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The output rows ``rows`` (int64 ``[n]``; an index of ``out_features`` or more
        gives a zero row, a padded vocabulary shard's) in this format: a tensor-parallel
        rank's shard of a column-parallel weight.  NotImplementedError where the format
        cannot (the weight is then dequantized for sharding)."""
        raise NotImplementedError(f"{type(self).__name__} cannot select rows")

    def select_columns(self, start: int, stop: int) -> QuantizedWeight | None:
        """The input columns ``[start, stop)`` in this format (a row-parallel shard), or
        None where they do not fall on the format's block boundaries.  NotImplementedError
        where the format cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot select columns")

    def prepared(self) -> QuantizedWeight:
        """This weight in the form its op multiplies fastest, once at load after fusion
        (``DecoderModel.prepare_linear_weights``); the weight itself by default."""
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(out={self.out_features}, in={self.in_features}, bytes={self.nbytes})"


class QuantizationMethod(ABC):
    """One quantization scheme.

    name: the ``quantization=`` value that selects it.
    required_ops: the ops its weights call.  pagedserve's own (``gguf_linear``, ...)
        exist on every platform, defaulting to their torch reference; a plugin's method
        may need an op that only some platforms register, and is refused elsewhere.
    platforms: None (every platform whose op registry has ``required_ops``), or the
        names of the platforms a method is limited to (others are refused, naming these).

    ``ops`` is the platform's op registry (:class:`pagedserve.platforms.ops.OpRegistry`
    or any object with the ops as attributes): weights take their op from it.
    """

    name: ClassVar[str]
    required_ops: ClassVar[tuple[str, ...]] = ()
    platforms: ClassVar[tuple[str, ...] | None] = None
    description: ClassVar[str] = ""

    def __init__(self, ops: Any, dtype: torch.dtype, config: dict[str, Any] | None = None) -> None:
        self.ops = ops
        self.dtype = dtype
        self.config = config or {}

    @abstractmethod
    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """``source``'s weights, with linear weights as :class:`QuantizedWeight`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, config={self.config!r})"
