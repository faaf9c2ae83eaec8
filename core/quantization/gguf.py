"""GGUF weights kept in their blocks: Q4_0 / Q4_1 / Q8_0 everywhere, Q5_0 / Q5_1 and the
K-quants Q4_K / Q5_K / Q6_K where the platform's ``gguf_linear`` declares a kernel for
them (``GGUF_EXTENDED``), each type of GGUF_OPTIONAL_TYPES (Q2_K, Q3_K, IQ4_NL, IQ4_XS) where it declares
that type's ``gguf_type:NAME``; other types are dequantized at load, with a log line
naming them.

The stored bytes of the .gguf file are the loaded format.  A file mixing types (llama.cpp's
Q4_K_M falls back to Q5_0 / Q8_0 per tensor) keeps each tensor in its own: a fused
projection (q/k/v, gate/up) whose parts differ is one weight of the widest type where the
others convert to it exactly (Q4_0 / Q5_0 parts beside a Q8_0 one become Q8_0 blocks of the
same values: :func:`widen_blocks`), else a :class:`StackedWeight` of same-type runs, and
one mixing blocks with a dequantized part is dequantized whole (``fuse``).  A weight multiplies through
the op registry's ``gguf_linear``, handed to it at load: the platforms choose the kernel
(the native CPU kernel of kernels/cpu/quant_gguf.cpp, Triton on CUDA/ROCm, the torch
reference elsewhere; see docs/quantization.md).  Once fused, each linear weight is put
through the registry's ``prepare_gguf_weight`` (``GGUFWeight.prepared``): the CPU
repacks the blocks for its tiled int8 GEMM there, in place of the file's blocks.  A tied
embedding and LM head share one prepared weight: embedding rows come from it through the
registry's ``gguf_embedding`` (no second copy of the vocabulary's blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.quant_reference import (
    GGUF_BASE_TYPES,
    GGUF_EXTENDED_TYPES,
    GGUF_OPTIONAL_TYPES,
    GGUF_TYPE_IDS,
    gguf_type_capability,
)
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight

__all__ = ["GGUFWeight", "GGUFMethod", "GGUF_KEPT_TYPES", "GGUF_TYPE_IDS", "gguf_kept_types"]

logger = logging.getLogger(__name__)

#: ggml types a GGUFWeight may hold; which of them a load keeps: :func:`gguf_kept_types`.
GGUF_KEPT_TYPES: tuple[str, ...] = GGUF_BASE_TYPES + GGUF_EXTENDED_TYPES + GGUF_OPTIONAL_TYPES
#: The op capability (``pagedserve.platforms.ops.GGUF_EXTENDED``) under which a
#: platform's gguf_linear takes GGUF_EXTENDED_TYPES too (a string here: the core does
#: not import the platforms package).
_EXTENDED_CAPABILITY = "gguf_extended_types"
#: The op capability (``pagedserve.platforms.ops.GGUF_OUT_DTYPE``) of a gguf_linear that
#: takes ``out_dtype``.
_OUT_DTYPE_CAPABILITY = "gguf_out_dtype"


def gguf_kept_types(ops) -> tuple[str, ...]:
    """The ggml types a .gguf keeps in blocks with op registry ``ops``: Q4_0/Q4_1/Q8_0,
    plus Q5_0/Q5_1/Q4_K/Q5_K/Q6_K where its ``gguf_linear`` declares a kernel for them
    (``gguf_extended_types``), plus each of GGUF_OPTIONAL_TYPES whose ``gguf_type:NAME``
    capability it declares."""
    has = getattr(ops, "has_capability", None)
    if has is None:
        return GGUF_BASE_TYPES
    kept = GGUF_BASE_TYPES + (GGUF_EXTENDED_TYPES if has("gguf_linear", _EXTENDED_CAPABILITY) else ())
    return kept + tuple(t for t in GGUF_OPTIONAL_TYPES if has("gguf_linear", gguf_type_capability(t)))


class GGUFWeight(QuantizedWeight):
    """data: uint8 ``[out, in/block_values * block_bytes]`` ggml blocks of type ``type_name``
    (32 values per block, 256 for the K-quants and IQ4_XS).

    op: the ``gguf_linear`` op to multiply with (the platform's, from its op registry);
        None means the torch reference.
    prepare: the same registry's ``prepare_gguf_weight`` (None: the blocks as they are).
    packed: what ``prepare`` returned for the blocks (set by :meth:`prepared`, which
        drops ``data``: None then); ``op`` multiplies with it.
    gated_op: the same registry's ``gguf_linear_silu_and_mul`` (None: ``op`` then the
        registry's ``silu_and_mul``), which a fused [gate; up] weight runs as a gated
        MLP's first half (:meth:`apply_silu_and_mul`).
    embed_op: the same registry's ``gguf_embedding`` (None: the reference, blocks only),
        which reads rows of the blocks or of their prepared form (:meth:`embedding`).
    op_out_dtype: whether ``op`` takes ``out_dtype`` (the registry's ``gguf_linear``
        declares ``gguf_out_dtype``; the reference does); else :meth:`apply` asked for
        float32 output hands it a float32 copy of x.
    stacked_op: the same registry's ``gguf_linear_stacked`` (None: a
        :class:`StackedWeight` of such weights applies them one by one), through which a
        fused projection of parts of different types multiplies in one call.
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
        embed_op: Callable | None = None,
        op_out_dtype: bool | None = None,
        stacked_op: Callable | None = None,
    ) -> None:
        if type_name not in GGUF_KEPT_TYPES:
            raise ValueError(f"GGUF type {type_name} is not kept quantized (supported: {', '.join(GGUF_KEPT_TYPES)})")
        if (data is None) == (packed is None):
            raise ValueError("a GGUFWeight holds either its blocks or their prepared form")
        per = ref.GGUF_BLOCK_VALUES[type_name]
        if data is not None and (in_features % per or data.shape[1] != ref.gguf_row_bytes(type_name, in_features)):
            raise ValueError(f"{type_name} rows of {data.shape[1]} bytes do not hold {in_features} values")
        self.type_name = type_name
        self.data = data
        self.out_features = data.shape[0] if data is not None else _out_features_of(packed, in_features, type_name)
        self.in_features = in_features
        self.op = op or reference.gguf_linear
        self.prepare = prepare
        self.packed = packed
        self.gated_op = gated_op
        self.embed_op = embed_op
        self.op_out_dtype = op is None if op_out_dtype is None else op_out_dtype
        self.stacked_op = stacked_op

    def _like(self, data: torch.Tensor | None, in_features: int, packed: torch.Tensor | None = None) -> GGUFWeight:
        """A weight of this type with this one's ops."""
        return GGUFWeight(
            self.type_name,
            data,
            in_features,
            self.op,
            self.prepare,
            packed,
            self.gated_op,
            self.embed_op,
            self.op_out_dtype,
            self.stacked_op,
        )

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x ``[M, in]`` -> ``[M, out]`` in ``out_dtype`` (None: x's dtype)."""
        data = self.data if self.packed is None else self.packed
        if out_dtype is None or out_dtype == x.dtype:
            return self.op(x, data, self.type_name, bias)
        if self.op_out_dtype:
            return self.op(x, data, self.type_name, bias, out_dtype)
        if out_dtype == torch.float32:  # the same values in float32: the float32 sums come back
            return self.op(x.float(), data, self.type_name, bias)
        return self.op(x, data, self.type_name, bias).to(out_dtype)

    def apply_silu_and_mul(self, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.gated_op is None:
            return silu_and_mul(self.apply(x, None))
        return self.gated_op(x, self.data if self.packed is None else self.packed, self.type_name, None)

    def prepared(self) -> GGUFWeight:
        """This weight with its blocks replaced by ``prepare(data)`` (the same bytes in the
        platform's own layout), or self without ``prepare``, when already prepared or when
        the op takes the blocks as they are.  A prepared weight only multiplies: its
        blocks are gone: rows for an embedding lookup come from the prepared form through
        ``embed_op`` (a tied embedding and LM head share it: :attr:`embeds_prepared`)."""
        if self.prepare is None or self.packed is not None:
            return self
        packed = self.prepare(self.data, self.type_name)
        if packed is self.data:
            return self
        return self._like(None, self.in_features, packed)

    @property
    def embeds_prepared(self) -> bool:
        """Whether :meth:`embedding` reads the prepared form (the registry's ``gguf_embedding``
        was handed over), so that the prepared weight can serve as the embedding too."""
        return self.embed_op is not None

    def _blocks(self) -> torch.Tensor:
        if self.data is None:
            raise ValueError(
                f"this {self.type_name} weight was repacked at load for its platform's gguf_linear: "
                "its blocks are no longer held (use the weight before prepared())"
            )
        return self.data

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` int64 ``[n]`` dequantized -> ``[n, in]`` dtype (an embedding lookup)."""
        if self.packed is not None and self.embed_op is not None:
            return self.embed_op(ids, self.packed, self.type_name, dtype)
        return ref.dequantize_gguf(self._blocks().index_select(0, ids), self.type_name).to(dtype)

    def select_rows(self, rows: torch.Tensor) -> GGUFWeight:
        """Whole rows of blocks; an index past the last row gives a row of zero bytes,
        which every kept type dequantizes to zeros (a padded vocabulary shard)."""
        data = self._blocks()
        data = torch.cat([data, data.new_zeros(1, data.shape[1])]).index_select(0, rows.clamp(max=self.out_features))
        return self._like(data, self.in_features)

    def select_columns(self, start: int, stop: int) -> GGUFWeight | None:
        """Whole blocks of each row (32 values, 256 for the K-quants and IQ4_XS); None when
        ``[start, stop)`` does not fall on block boundaries."""
        per = ref.GGUF_BLOCK_VALUES[self.type_name]
        if start % per or stop % per:
            return None
        row_bytes = ref.gguf_row_bytes(self.type_name, per)  # the bytes of one block
        data = self._blocks()[:, start // per * row_bytes : stop // per * row_bytes].contiguous()
        return self._like(data, stop - start)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ref.dequantize_gguf(self._blocks(), self.type_name).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data if self.packed is None else self.packed]

    def to(self, device: torch.device) -> GGUFWeight:
        if self.tensors()[0].device == device:
            return self
        # A prepared form belongs to its platform: only the blocks move.
        return self._like(self._blocks().to(device), self.in_features)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """One weight of the parts' type where all share it, or of the widest type where the
        others convert to it exactly (a Q4_K_M's [q; k] Q5_0 and v Q8_0: all Q8_0, one
        kernel call; :func:`widen_blocks`), else a :class:`StackedWeight` of runs of
        consecutive parts of one type."""
        target = _common_type(parts)
        if target is not None and any(p.type_name != target for p in parts):  # type: ignore[attr-defined]
            return _cat_blocks([p if p.type_name == target else _widened(p, target) for p in parts])  # type: ignore[attr-defined]
        runs: list[list[QuantizedWeight]] = []
        for p in parts:
            if runs and _same_blocks(runs[-1][0], p):
                runs[-1].append(p)
            else:
                runs.append([p])
        fused = [_cat_blocks(run) if isinstance(run[0], GGUFWeight) and len(run) > 1 else run[0] for run in runs]
        return fused[0] if len(fused) == 1 else StackedWeight(fused)


#: Exact conversions of 32-value block types: every value of the narrower type is a value
#: of the wider one with the same fp16 scale (and minimum), see :func:`widen_blocks`.
WIDER_TYPES: dict[str, tuple[str, ...]] = {"Q4_0": ("Q5_0", "Q8_0"), "Q5_0": ("Q8_0",), "Q4_1": ("Q5_1",)}


def _common_type(parts: list[QuantizedWeight]) -> str | None:
    """The type every part is or widens to exactly (None: parts that are not all GGUF
    blocks, or no such type)."""
    if not all(isinstance(p, GGUFWeight) and p.data is not None for p in parts):
        return None
    types = {p.type_name for p in parts}  # type: ignore[attr-defined]
    for t in types:
        if all(o == t or t in WIDER_TYPES.get(o, ()) for o in types):
            return t
    return None


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 16]`` -> int16 ``[..., 32]``: the low nibbles, then the high ones."""
    q = qs.to(torch.int16)
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4]`` (a little-endian u32) -> int16 ``[..., 32]``: bit j."""
    return ((qh.to(torch.int16)[..., None] >> torch.arange(8, dtype=torch.int16)) & 1).flatten(-2)


def widen_blocks(data: torch.Tensor, type_name: str, target: str) -> torch.Tensor:
    """GGUF blocks uint8 ``[n, row_bytes]`` of ``type_name`` as blocks of ``target`` holding
    exactly the same values (``target`` in ``WIDER_TYPES[type_name]``): Q4_0 ``d (q - 8)``
    and Q5_0 ``d (q - 16)`` as Q8_0 ``d q'`` with ``q' = q - 8`` or ``q - 16``; Q4_0 as Q5_0
    with ``q + 8``; Q4_1 ``d q + m`` as Q5_1 with no fifth bits."""
    if target not in WIDER_TYPES.get(type_name, ()):
        raise ValueError(f"GGUF {type_name} blocks do not convert exactly to {target}")
    n = data.shape[0]
    blocks = data.reshape(n, -1, ref.GGUF_BLOCK_BYTES[type_name])
    head = blocks[..., : 4 if type_name == "Q4_1" else 2]  # d (and m)
    if type_name == "Q4_1":  # Q5_1: d | m | qh = 0 | the same qs
        zeros = torch.zeros(*blocks.shape[:2], 4, dtype=torch.uint8)
        return torch.cat([head, zeros, blocks[..., 4:]], dim=-1).reshape(n, -1)
    if type_name == "Q4_0":
        q = _nibbles(blocks[..., 2:18]) - 8
    else:
        q = (_nibbles(blocks[..., 6:22]) | (_fifth_bits(blocks[..., 2:6]) << 4)) - 16
    if target == "Q8_0":
        return torch.cat([head, q.to(torch.int8).view(torch.uint8)], dim=-1).reshape(n, -1)
    q = q + 16  # Q4_0 -> Q5_0: 8..23
    low = (q & 0x0F).to(torch.uint8)
    qs = low[..., :16] | (low[..., 16:] << 4)
    weights = torch.ones(8, dtype=torch.int16) << torch.arange(8, dtype=torch.int16)
    qh = ((q >> 4).reshape(*q.shape[:-1], 4, 8) * weights).sum(-1).to(torch.uint8)
    return torch.cat([head, qh, qs], dim=-1).reshape(n, -1)


def _widened(w: GGUFWeight, target: str) -> GGUFWeight:
    return GGUFWeight(
        target,
        widen_blocks(w._blocks(), w.type_name, target),
        w.in_features,
        w.op,
        w.prepare,
        None,
        w.gated_op,
        w.embed_op,
        w.op_out_dtype,
        w.stacked_op,
    )


def _same_blocks(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return isinstance(a, GGUFWeight) and isinstance(b, GGUFWeight) and a.type_name == b.type_name


def _cat_blocks(parts: list[QuantizedWeight]) -> GGUFWeight:
    first = parts[0]
    assert isinstance(first, GGUFWeight)
    data = torch.cat([p._blocks() for p in parts])  # type: ignore[attr-defined]
    return first._like(data, first.in_features)


def _out_features_of(packed: torch.Tensor, in_features: int, type_name: str) -> int:
    """Output rows of a prepared weight: its bytes over the bytes of one row of blocks
    (a platform's layout holds the file's bytes, in its own order)."""
    return packed.numel() // ref.gguf_row_bytes(type_name, in_features)


class StackedWeight(QuantizedWeight):
    """Several weights with one input, outputs concatenated (for fusions of mixed types)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        #: Float32 sums (and ``out_dtype``) where every part has them.
        self.float32_accumulation = all(p.float32_accumulation for p in parts)  # type: ignore[misc]
        # GGUF blocks whose ops share one gguf_linear_stacked multiply through it in one call
        # (asked for another out_dtype only where their gguf_linear takes it).
        ops = {getattr(p, "stacked_op", None) for p in parts}
        gguf = all(isinstance(p, GGUFWeight) for p in parts)
        self._stacked_op: Callable | None = ops.pop() if gguf and len(ops) == 1 else None
        self._stacked_out_dtype = gguf and all(p.op_out_dtype for p in parts)  # type: ignore[attr-defined]
        self._type_names = [p.type_name for p in parts] if gguf else []  # type: ignore[attr-defined]

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        op = self._stacked_op
        if op is not None and (out_dtype is None or out_dtype == x.dtype or self._stacked_out_dtype):
            # One call: each part's sums (+ its bias) rounded once, written side by side.
            data = [p.data if p.packed is None else p.packed for p in self.parts]  # type: ignore[attr-defined]
            return op(x, data, self._type_names, bias, None if out_dtype == x.dtype else out_dtype)
        if out_dtype is None or out_dtype == x.dtype:
            y = torch.cat([p.apply(x) for p in self.parts], dim=-1)
        elif self.float32_accumulation:
            y = torch.cat([p.apply(x, None, out_dtype) for p in self.parts], dim=-1)  # type: ignore[call-arg]
        else:
            y = torch.cat([p.apply(x) for p in self.parts], dim=-1).to(out_dtype)
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
    """``quantization="gguf"``: tensors of a .gguf stay in blocks (linear layers, the
    embedding and an untied LM head) where their type is kept (:func:`gguf_kept_types`);
    other types are dequantized at load, each named once in the log."""

    name = "gguf"
    description = "GGUF blocks kept quantized (Q4_0/Q4_1/Q8_0; Q5_x and K-quants where the platform has kernels)"
    required_ops = ("gguf_linear",)

    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        gguf = getattr(source, "_gguf", None)
        if gguf is None:
            raise ValueError(f"quantization='gguf' needs a .gguf file; {source.path} is a Hugging Face folder")
        op, prepare = self.ops.gguf_linear, self.ops.prepare_gguf_weight
        gated, embed = self.ops.gguf_linear_silu_and_mul, getattr(self.ops, "gguf_embedding", None)
        stacked = getattr(self.ops, "gguf_linear_stacked", None)
        has = getattr(self.ops, "has_capability", None)
        out_dtype = op is reference.gguf_linear or (has is not None and has("gguf_linear", _OUT_DTYPE_CAPABILITY))
        if prepare is not reference.prepare_gguf_weight and embed is reference.gguf_embedding:
            embed = None  # the reference reads rows of blocks, not of another prepared form
        kept = gguf_kept_types(self.ops)
        _log_dequantized(gguf.tensor_types(), kept)
        for name, t in gguf.weights(keep_quantized=kept):
            if isinstance(t, torch.Tensor):
                yield name, t
            else:
                yield (
                    name,
                    GGUFWeight(
                        t.type_name,
                        t.data,
                        t.shape[1],
                        op,
                        prepare,
                        gated_op=gated,
                        embed_op=embed,
                        op_out_dtype=out_dtype,
                        stacked_op=stacked,
                    ),
                )


#: Types that are floats already: loading them as floats is no fallback.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def _log_dequantized(types: dict[str, str], kept: tuple[str, ...]) -> None:
    """One log line per quantized ggml type that loads dequantized (no kept kernel)."""
    counts: dict[str, int] = {}
    for type_name in types.values():
        if type_name not in kept and type_name not in _FLOAT_TYPES:
            counts[type_name] = counts.get(type_name, 0) + 1
    for type_name, n in sorted(counts.items()):
        logger.info(
            "GGUF type %s has no kept kernel on this platform: %d tensor(s) dequantized at load (kept: %s)",
            type_name,
            n,
            ", ".join(kept),
        )
