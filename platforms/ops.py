"""The op registry: named ops that model code calls, overridable per platform.

Every op starts as the torch reference in :mod:`pagedserve.kernels.reference`;
plugins override ops through the ``pagedserve_register_ops`` hook.  Model code calls
``ops.paged_attention(...)`` and never knows which implementation runs; quantized
weights are handed their op (``ops.gguf_linear``, ``ops.fp8_linear``, ...) when they
load.

An implementation may declare capabilities (:data:`OP_CAPABILITIES`) when it registers;
the core asks for a capability (``ops.has_capability("gguf_linear", PREFERS_QUANTIZED)``)
instead of matching the ``source`` string, which is for people to read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kernels import quant_reference, reference

__all__ = [
    "OpRegistry",
    "OpEntry",
    "OP_CAPABILITIES",
    "PREFERS_QUANTIZED",
    "GGUF_EXTENDED",
    "FLOAT32_RESIDUAL",
    "GGUF_OUT_DTYPE",
    "REFERENCE_CAPABILITIES",
]

#: A quantized linear op declaring this runs faster on the quantized weights than the
#: dense ``linear`` on dequantized ones at decode batch sizes, so a quantized checkpoint
#: stays quantized when the user leaves ``quantization`` unset (docs/quantization.md).
PREFERS_QUANTIZED = "prefers_quantized"
#: A ``gguf_linear`` declaring this has its own kernel for the GGUF block types beyond
#: Q4_0/Q4_1/Q8_0 (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: ``quant_reference.GGUF_EXTENDED_TYPES``),
#: so a .gguf keeps those blocks too; elsewhere they are dequantized at load.
GGUF_EXTENDED = "gguf_extended_types"
#: One capability per type of ``quant_reference.GGUF_OPTIONAL_TYPES`` (``"gguf_type:NAME"``,
#: :func:`~pagedserve.kernels.quant_reference.gguf_type_capability`): a ``gguf_linear``
#: declaring it has a kernel for that type, so a .gguf keeps its blocks (interface 1.10).
#: A ``fused_add_rms_norm`` declaring this takes a float32 residual beside a bfloat16 /
#: float16 ``x`` and an ``out_dtype`` for the normalised row (reference.fused_add_rms_norm),
#: so that a model may keep its residual stream in float32 (``residual_dtype``).
FLOAT32_RESIDUAL = "float32_residual"
#: A ``gguf_linear`` declaring this takes ``out_dtype`` (reference.gguf_linear): float32
#: sums written unrounded from a bfloat16 / float16 x.  Without it a GGUF weight asked for
#: float32 output feeds the op a float32 copy of x (the same values, one more pass).
GGUF_OUT_DTYPE = "gguf_out_dtype"

#: Every capability an op implementation may declare (interface 1.3), with its meaning.
OP_CAPABILITIES: dict[str, str] = {
    PREFERS_QUANTIZED: "faster on quantized weights than dense linear on dequantized ones at decode batch sizes",
    GGUF_EXTENDED: "gguf_linear: a kernel for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks too (kept quantized at load)",
    FLOAT32_RESIDUAL: "fused_add_rms_norm: a float32 residual beside a bf16/fp16 x, and out_dtype (interface 1.7)",
    GGUF_OUT_DTYPE: "gguf_linear: out_dtype, float32 sums unrounded from a bf16/fp16 x (interface 1.7)",
    **{
        quant_reference.gguf_type_capability(t): f"gguf_linear: a kernel for {t} blocks (kept quantized at load)"
        for t in quant_reference.GGUF_OPTIONAL_TYPES
    },
}

#: The capabilities of the reference implementations (registered by every OpRegistry).
REFERENCE_CAPABILITIES: dict[str, tuple[str, ...]] = {
    "fused_add_rms_norm": (FLOAT32_RESIDUAL,),
    "gguf_linear": (GGUF_OUT_DTYPE,),
}


@dataclass(frozen=True)
class OpEntry:
    fn: Callable[..., Any]
    source: str
    capabilities: frozenset[str] = frozenset()


class OpRegistry:
    """A mapping from op name to implementation, with attribute access for speed."""

    def __init__(self) -> None:
        self._entries: dict[str, OpEntry] = {}
        for name in reference.OP_NAMES:
            self.register(
                name, getattr(reference, name), source="reference", capabilities=REFERENCE_CAPABILITIES.get(name, ())
            )
        # A fused op's default is the composition of this registry's own parts, looked up
        # at call time: a platform that overrides only the parts (e.g. a linear taking
        # its own prepared weights) gets them without registering the fused op.
        self.register("linear_silu_and_mul", self._linear_silu_and_mul, source="reference")
        self.register("gguf_linear_silu_and_mul", self._gguf_linear_silu_and_mul, source="reference")
        self.register("gguf_linear_stacked", self._gguf_linear_stacked, source="reference")
        self.register("rotary_paged_attention", self._rotary_paged_attention, source="reference")

    def _linear_silu_and_mul(self, x, weight, bias=None):
        """See reference.linear_silu_and_mul: this registry's silu_and_mul(linear(...))."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def _gguf_linear_silu_and_mul(self, x, data, type_name, bias=None):
        """See reference.gguf_linear_silu_and_mul: this registry's silu_and_mul(gguf_linear(...))."""
        return self.silu_and_mul(self.gguf_linear(x, data, type_name, bias))

    def _rotary_paged_attention(
        self, positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, block_tables,
        seq_lens, query_start_loc, scale, out=None,
    ):  # fmt: skip
        """See reference.rotary_paged_attention: this registry's rotary_embedding,
        reshape_and_cache and paged_attention."""
        query, key = self.rotary_embedding(positions, query, key, cos_sin_cache)
        self.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return self.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)

    def _gguf_linear_stacked(self, x, data, type_names, bias=None, out_dtype=None):
        """See reference.gguf_linear_stacked: this registry's gguf_linear once per part."""
        ys, at = [], 0
        for d, t in zip(data, type_names):
            n = d.numel() // quant_reference.gguf_row_bytes(t, x.shape[-1])  # a prepared form holds the blocks' bytes
            b = None if bias is None else bias[at : at + n]
            ys.append(self.gguf_linear(x, d, t, b) if out_dtype is None else self.gguf_linear(x, d, t, b, out_dtype))
            at += n
        return torch.cat(ys, dim=-1)

    def register(self, name: str, fn: Callable[..., Any], source: str = "", capabilities: Iterable[str] = ()) -> None:
        """Make ``name`` resolve to ``fn``; ``source`` says where it came from;
        ``capabilities`` (names of :data:`OP_CAPABILITIES`) are what ``fn`` declares, and
        go with it (an override declares its own)."""
        if not callable(fn):
            raise TypeError(f"op {name!r}: implementation {fn!r} is not callable")
        if not name.isidentifier():
            raise ValueError(f"op name {name!r} is not a valid identifier")
        declared = frozenset([capabilities] if isinstance(capabilities, str) else capabilities)
        unknown = sorted(declared - OP_CAPABILITIES.keys())
        if unknown:
            raise ValueError(
                f"op {name!r}: unknown capabilities {unknown}; known: {', '.join(sorted(OP_CAPABILITIES))}"
            )
        self._entries[name] = OpEntry(fn, source or getattr(fn, "__module__", "?"), declared)
        # Plain attribute so the hot path pays one attribute lookup per call.
        setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"no op named {name!r}; known ops: {', '.join(sorted(self._entries))}")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., Any]:
        return getattr(self, name)

    def source(self, name: str) -> str:
        return self._entries[name].source

    def has_capability(self, name: str, capability: str) -> bool:
        """Whether op ``name``'s implementation declared ``capability`` (False for an unknown op)."""
        if capability not in OP_CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {', '.join(sorted(OP_CAPABILITIES))}")
        entry = self._entries.get(name)
        return entry is not None and capability in entry.capabilities

    def names(self) -> list[str]:
        return list(self._entries)

    def table(self) -> list[tuple[str, str]]:
        return [(n, e.source) for n, e in self._entries.items()]
