"""Torch references of every quantized matmul: dequantize the weight, then matmul.

These are the specification the fast kernels (native CPU, Triton) are tested against,
and the fallback wherever no fast kernel exists.  Each ``*_linear`` takes activations
``x`` ``[M, K]`` (float32, bfloat16 or float16), computes in float32 and returns
``x.dtype`` ``[M, N]``; a linear weight is ``[N, K]`` (out, in) once dequantized.  The
quantized linear ops of the op registry (``gguf_linear``, ``int8_linear``,
``w8a8_linear``, ``fp8_linear`` in :mod:`pagedserve.kernels.reference`) are these.

The ``*_dense`` functions at the end are not specifications: they dequantize the weight
to the activation dtype and run one matmul in that dtype, which is what platforms
without a dedicated kernel register where a half-precision matmul beats the float32
reference (the weight is rounded to ``x.dtype``; the conformance tolerances allow it).

Formats:

- GGUF (ggml-common.h), 32 values per block, little-endian, ``d``/``m`` fp16:
  Q8_0 ``d | int8 q[32]`` -> q*d; Q4_0 ``d | u8 qs[16]`` -> (nibble-8)*d;
  Q4_1 ``d | m | u8 qs[16]`` -> nibble*d + m; element j < 16 is the low nibble of
  ``qs[j]``, element j + 16 its high nibble.  Q5_0 ``d | u32 qh | u8 qs[16]`` ->
  (q - 16)*d and Q5_1 ``d | m | u32 qh | u8 qs[16]`` -> q*d + m, with bit j of ``qh``
  the fifth bit of element j.
- GGUF K-quants, 256 values per super-block (``GGUF_BLOCK_VALUES``): Q4_K ``d | dmin |
  u8 scales[12] | u8 qs[128]`` and Q5_K ``d | dmin | scales[12] | u8 qh[32] | qs[128]``
  hold 8 sub-blocks of 32 with 6-bit scales ``sc`` and minimums ``mn`` (packed as below,
  :func:`kquant_scales_mins`): value = d*sc*q - dmin*mn; each 32 bytes of ``qs`` hold
  two sub-blocks (low nibbles, then high nibbles), and Q5_K's fifth bit of element l of
  sub-block j is bit j of ``qh[l]``.  Q6_K ``u8 ql[128] | u8 qh[64] | int8 scales[16] |
  d`` holds 16 sub-blocks of 16: value = d*scale*(q - 32), q 6 bits (four from ``ql``,
  two from ``qh``; see :func:`_q6_k`).  Q2_K ``u8 scales[16] | u8 qs[64] | d | dmin``
  holds 16 sub-blocks of 16 with a 4-bit scale (low nibble of ``scales[r]``) and a 4-bit
  minimum (high nibble): value = d*sc*q - dmin*mn, q 2 bits; element 32j + l of the
  128-value half h (j = 0..3, l = 0..31) is bits 2j, 2j+1 of ``qs[32h + l]`` (:func:`_q2_k`).
  Q3_K ``u8 hmask[32] | u8 qs[64] | u8 scales[12] | d`` holds 16 sub-blocks of 16: value
  = d*(sc - 32)*(q - 4), q 3 bits (two from ``qs``, the third from ``hmask``) and sc 6
  bits (see :func:`_q3_k`).
- GGUF IQ4_NL (non-linear 4-bit, 32 values per block): ``d | u8 qs[16]``, the nibbles
  placed as Q4_0's, each an index into the fixed table ``IQ4_NL_VALUES`` of 16 int8
  values (ggml's ``kvalues_iq4nl``): value = d * IQ4_NL_VALUES[nibble].
- GGUF IQ4_XS (256 values per super-block, 136 bytes): ``d | u16 scales_h | u8
  scales_l[4] | u8 qs[128]``: 8 sub-blocks of 32 with IQ4_NL's levels and a 6-bit
  sub-block scale ``ls`` (low 4 bits: nibble ``j % 2`` of ``scales_l[j // 2]``; top 2:
  bits 2j, 2j+1 of ``scales_h``): value = (d * (ls - 32)) * IQ4_NL_VALUES[nibble]; sub-block
  j's nibbles are ``qs[16j : 16j + 16]``, placed as IQ4_NL's (:func:`_iq4_xs`).
- INT8: int8 ``[N, K]`` with float32 per-output-channel scales ``[N]``.
- FP8: ``float8_e4m3fn`` ``[N, K]`` with a float32 scale ``[]`` (per tensor) or ``[N]``.
- GPTQ (AutoGPTQ / transformers, ``checkpoint_format="gptq"``): qweight int32
  ``[K/8, N]`` packs 8 rows along K (row 8i+j in bits 4j..4j+3); qzeros int32
  ``[G, N/8]`` packs along N and stores zero-1; scales fp16 ``[G, N]``; g_idx int32
  ``[K]`` (the group of each input row; act-order makes it a permutation of groups).
- AWQ (AutoAWQ GEMM): qweight int32 ``[K, N/8]`` and qzeros int32 ``[G, N/8]`` pack
  along N in the interleaved order (nibble i holds column ``AWQ_ORDER[i]`` of each 8);
  scales fp16 ``[G, N]``; group of row k is ``k // group_size``; value (q - z) * s.
"""

from __future__ import annotations

import torch

__all__ = [
    "GGUF_BLOCK_BYTES",
    "GGUF_TYPE_IDS",
    "GGUF_BLOCK_VALUES",
    "GGUF_BASE_TYPES",
    "GGUF_EXTENDED_TYPES",
    "GGUF_OPTIONAL_TYPES",
    "IQ4_NL_VALUES",
    "gguf_type_capability",
    "gguf_row_bytes",
    "kquant_scales_mins",
    "q3_k_scales",
    "iq4_xs_scales",
    "AWQ_ORDER",
    "dequantize_gguf",
    "gguf_linear",
    "quantize_per_token_int8",
    "int8_linear",
    "w8a8_linear",
    "fp8_linear",
    "unpack_int4_rows",
    "unpack_int4_cols",
    "gptq_dequantize",
    "gptq_linear",
    "awq_dequantize",
    "awq_linear",
    "gguf_linear_dense",
    "int8_linear_dense",
    "fp8_linear_dense",
]

#: Bytes of one block per ggml type (32 values, or 256 for K-quants: GGUF_BLOCK_VALUES).
GGUF_BLOCK_BYTES: dict[str, int] = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q8_0": 34,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "Q2_K": 84,
    "Q3_K": 110,
    "IQ4_NL": 18,
    "IQ4_XS": 136,
}
#: Values per block of each type of GGUF_BLOCK_BYTES (256: the K-quants' and IQ4_XS's super-blocks).
GGUF_BLOCK_VALUES: dict[str, int] = {t: 256 if t.endswith("_K") or t == "IQ4_XS" else 32 for t in GGUF_BLOCK_BYTES}
#: ggml's type ids (``enum ggml_type``) of the block types kept quantized.
GGUF_TYPE_IDS: dict[str, int] = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 8,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "Q2_K": 10,
    "Q3_K": 11,
    "IQ4_NL": 20,
    "IQ4_XS": 23,
}
#: The 32-value types of the first kernels (Q4_0, Q4_1, Q8_0): the others are the
#: "extended" types (GGUF_EXTENDED_TYPES), which a platform's gguf_linear takes only
#: where it declares so (``pagedserve.platforms.ops.GGUF_EXTENDED``).
GGUF_BASE_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0")
GGUF_EXTENDED_TYPES: tuple[str, ...] = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
#: Types a platform's gguf_linear takes one by one: each where it declares the op
#: capability ``gguf_type_capability(name)`` (``"gguf_type:NAME"``), so adding a type
#: here never changes what an existing capability promises.
GGUF_OPTIONAL_TYPES: tuple[str, ...] = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
#: IQ4_NL's 16 levels (ggml-common.h ``kvalues_iq4nl``), indexed by the stored nibble.
IQ4_NL_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: AWQ's pack order: nibble i of each int32 holds column AWQ_ORDER[i] of its 8 columns.
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of each block ``[..., block_bytes]`` -> float32 ``[..., 1]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def gguf_type_capability(type_name: str) -> str:
    """The op capability under which a gguf_linear takes ``type_name`` (one of
    GGUF_OPTIONAL_TYPES) kept in its blocks."""
    return f"gguf_type:{type_name}"


def gguf_row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of ``k`` values of ``type_name`` (ValueError unless whole blocks)."""
    per = GGUF_BLOCK_VALUES[type_name]
    if k % per:
        raise ValueError(f"{type_name} rows hold whole blocks of {per} values; {k} is not a multiple")
    return k // per * GGUF_BLOCK_BYTES[type_name]


def dequantize_gguf(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 ``[N, K/block_values * block_bytes]`` GGUF rows -> float32 ``[N, K]``."""
    bb = GGUF_BLOCK_BYTES[type_name]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, bb)
    if type_name in _EXTENDED_DEQUANT:
        return _EXTENDED_DEQUANT[type_name](blocks).reshape(n, -1)
    if type_name == "Q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        if type_name == "Q4_0":
            values = (q - 8) * _half(blocks, 0)
        else:
            values = q * _half(blocks, 0) + _half(blocks, 2)
    return values.reshape(n, -1)


def _bits(words: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., b]`` -> ``[..., b, 8]`` of their bits, least significant first (int64)."""
    shifts = torch.arange(8, device=words.device)
    return (words[..., None].long() >> shifts) & 1


def _q5(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit values (0..31) of Q5_0 / Q5_1 blocks ``[..., bb]`` -> int64 ``[..., 32]``."""
    qs = blocks[..., qh_at + 4 : qh_at + 20].long()
    high = _bits(blocks[..., qh_at : qh_at + 4]).flatten(-2)  # bit j of the little-endian u32
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_q5(blocks, 2) - 16).float() * _half(blocks, 0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _q5(blocks, 4).float() * _half(blocks, 0) + _half(blocks, 2)


def kquant_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K ``scales[12]`` (uint8 ``[..., 12]``) -> the 8 sub-blocks' 6-bit scales
    and minimums, int64 ``[..., 8]`` each.  Sub-blocks 0-3: the low 6 bits of bytes 0-3
    (scales) and 4-7 (minimums); sub-blocks 4-7: the low and high nibbles of bytes 8-11
    with the top 2 bits of bytes 0-3 (scales) and 4-7 (minimums) above them."""
    s = scales.long()
    lo = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return lo, mn


def _kquant_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``qs[128]`` -> int64 ``[..., 8, 32]``: sub-block 2i is the low nibbles of bytes
    32i..32i+31, sub-block 2i+1 their high nibbles."""
    q = qs.long().reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([q & 0x0F, q >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * sc * q - dmin * mn over ``q`` ``[..., 8, 32]`` of Q4_K / Q5_K blocks."""
    sc, mn = kquant_scales_mins(blocks[..., 4:16])
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    values = (d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]
    return values.flatten(-2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_scaled(blocks, _kquant_nibbles(blocks[..., 16:144]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = _bits(blocks[..., 16:48]).transpose(-1, -2)  # [..., 8 sub-blocks, 32]: bit j of qh[l]
    return _k_scaled(blocks, _kquant_nibbles(blocks[..., 48:176]) | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 values, each from 64 bytes of ``ql`` and 32 of ``qh``: element
    32c + l of a half (c = 0..3, l = 0..31) has low bits ``ql[l + 32 (c % 2)]``'s low
    (c < 2) or high nibble, high bits ``(qh[l] >> 2c) & 3``; value d * scales[v // 16] *
    (q - 32) for element v of the super-block."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].long().reshape(*lead, 2, 2, 32)  # [half, byte group, l]
    qh = blocks[..., 128:192].long().reshape(*lead, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2)  # [half, c, l] for c = 0, 1 (low), 2, 3 (high)
    high = (qh >> (2 * torch.arange(4, device=blocks.device)).reshape(4, 1)) & 3
    q = (low | (high << 4)) - 32  # [..., 2, 4, 32]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [..., 16]
    d = _half(blocks, 208)
    return q.reshape(*lead, 16, 16).float() * (d * scales)[..., None]


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 values, each from 32 bytes of ``qs``: element 32j + l of half h
    is ``(qs[32h + l] >> 2j) & 3``; value d * (scales[v // 16] & 15) * q - dmin *
    (scales[v // 16] >> 4) for element v of the super-block (as ggml: the two products
    first, in float32)."""
    lead = blocks.shape[:-1]
    qs = blocks[..., 16:80].long().reshape(*lead, 2, 1, 32)  # [half, 1, l]
    q = (qs >> (2 * torch.arange(4, device=blocks.device)).reshape(4, 1)) & 3  # [..., 2, 4, 32]
    s = blocks[..., 0:16].long()
    dl = _half(blocks, 80) * (s & 0x0F).float()  # [..., 16]
    ml = _half(blocks, 82) * (s >> 4).float()
    return (dl[..., None] * q.reshape(*lead, 16, 16).float() - ml[..., None]).flatten(-2)


def q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """Q3_K ``scales[12]`` (uint8 ``[..., 12]``) -> the 16 sub-blocks' 6-bit scales, int64
    ``[..., 16]`` (before ``- 32``): the low 4 bits of scale i are the low (i < 8) or high
    nibble of byte i % 8, its top 2 bits bits 2 (i // 4) of byte 8 + i % 4."""
    s = scales.long()
    low = torch.cat([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], dim=-1)
    shifts = (2 * torch.arange(4, device=scales.device)).reshape(4, 1)
    top = (s[..., None, 8:12] >> shifts) & 3  # [..., i // 4, i % 4]
    return low | (top.flatten(-2) << 4)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 values, each from 32 bytes of ``qs``: element 32j + l of half n
    (j = 0..3, l = 0..31) has low bits ``(qs[32n + l] >> 2j) & 3`` and, where bit 4n + j
    of ``hmask[l]`` is set, 4 more; value d * (sc[v // 16] - 32) * (q - 4) for element v
    of the super-block (q 0..7)."""
    lead = blocks.shape[:-1]
    qs = blocks[..., 32:96].long().reshape(*lead, 2, 1, 32)  # [half, 1, l]
    low = (qs >> (2 * torch.arange(4, device=blocks.device)).reshape(4, 1)) & 3  # [..., 2, 4, 32]
    high = _bits(blocks[..., 0:32]).transpose(-1, -2).reshape(*lead, 2, 4, 32)  # bit 4n + j of hmask[l]
    q = low + 4 * high - 4
    sc = (q3_k_scales(blocks[..., 96:108]) - 32).float()
    d = _half(blocks, 108)
    return q.reshape(*lead, 16, 16).float() * (d * sc)[..., None]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[..., 2:18].long()
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=blocks.device)
    return table[torch.cat([qs & 0x0F, qs >> 4], dim=-1)] * _half(blocks, 0)


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks ``[..., 136]`` -> the 8 sub-blocks' 6-bit scales minus 32, int64
    ``[..., 8]`` (-32..31): the low 4 bits of scale j are nibble ``j % 2`` of
    ``scales_l[j // 2]`` (byte 4 + j // 2), its top 2 bits bits 2j, 2j+1 of the
    little-endian uint16 ``scales_h`` (bytes 2-3)."""
    low = blocks[..., 4:8].long()
    low = torch.stack([low & 0x0F, low >> 4], dim=-1).flatten(-2)
    high = blocks[..., 2].long() | (blocks[..., 3].long() << 8)
    top = (high[..., None] >> (2 * torch.arange(8, device=blocks.device))) & 3
    return (low | (top << 4)) - 32


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """Sub-block j (32 values) from ``qs[16j : 16j + 16]`` (element l < 16 the low nibble
    of byte l, l + 16 its high nibble): (d * (ls_j - 32)) * level, the scale product first
    in float32, as ggml's dequantize_row_iq4_xs."""
    lead = blocks.shape[:-1]
    qs = blocks[..., 8:136].long().reshape(*lead, 8, 16)
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=blocks.device)
    levels = table[torch.cat([qs & 0x0F, qs >> 4], dim=-1)]  # [..., 8, 32]
    dl = _half(blocks, 0) * iq4_xs_scales(blocks).float()  # [..., 8]
    return (dl[..., None] * levels).flatten(-2)


_EXTENDED_DEQUANT = {
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def gguf_linear(
    x: torch.Tensor,
    raw: torch.Tensor,
    type_name: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x ``[M, K]`` @ dequantized GGUF rows ``[N, K]``^T (+ bias ``[N]``) -> ``[M, N]`` in
    ``out_dtype`` (None: x.dtype)."""
    return _finish(x.float() @ dequantize_gguf(raw, type_name).t(), bias, x.dtype if out_dtype is None else out_dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic per-row quantization: x ``[M, K]`` -> (int8 ``[M, K]``, float32 scale ``[M, 1]``)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only INT8 (W8A16): qweight int8 ``[N, K]``, scale float32 ``[N]``."""
    w = qweight.float() * scale.float()[:, None]
    return _finish(x.float() @ w.t(), bias, x.dtype)


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8: x quantized per token (``quantize_per_token_int8``), integer products, both scales after."""
    xq, xs = quantize_per_token_int8(x)
    y = (xq.float() @ qweight.float().t()) * xs * scale.float()[None, :]
    return _finish(y, bias, x.dtype)


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 e4m3 weights: qweight ``[N, K]``, scale float32 ``[]`` or ``[N]``."""
    s = scale.float()
    w = qweight.float() * (s[:, None] if s.dim() == 1 else s)
    return _finish(x.float() @ w.t(), bias, x.dtype)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R/8, C]`` packed along rows (row 8i+j in bits 4j..) -> int32 ``[R, C]`` in [0, 15]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, packed.shape[1])


def unpack_int4_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, C/8]`` packed along columns -> int32 ``[R, C]``; ``order[i]`` is the column
    held in nibble i (None: nibble j holds column j)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C/8, nibble]
    if order is not None:
        inverse = [order.index(j) for j in range(8)]  # nibble holding column j
        q = q[:, :, inverse]
    return q.reshape(packed.shape[0], -1)


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """GPTQ 4-bit -> float32 ``[N, K]`` (see the module docstring for the layout)."""
    q = unpack_int4_rows(qweight)  # [K, N]
    z = unpack_int4_cols(qzeros) + 1  # [G, N]; checkpoints store zero - 1
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]
    return w.t()


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _finish(x.float() @ gptq_dequantize(qweight, qzeros, scales, g_idx).t(), bias, x.dtype)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ 4-bit -> float32 ``[N, K]`` (see the module docstring for the layout)."""
    q = unpack_int4_cols(qweight, AWQ_ORDER)  # [K, N]
    z = unpack_int4_cols(qzeros, AWQ_ORDER)  # [G, N]
    g = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - z[g]).float() * scales.float()[g]
    return w.t()


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _finish(x.float() @ awq_dequantize(qweight, qzeros, scales, group_size).t(), bias, x.dtype)


# -- dense paths (not specifications; see the module docstring) ----------------------------


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def gguf_linear_dense(
    x: torch.Tensor, raw: torch.Tensor, type_name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``gguf_linear`` with the weight dequantized to x.dtype: one dense matmul (prefill-sized x)."""
    return _dense(x, dequantize_gguf(raw, type_name).to(x.dtype), bias)


def int8_linear_dense(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``int8_linear`` with the weight dequantized to x.dtype."""
    return _dense(x, qweight.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


def fp8_linear_dense(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``fp8_linear`` with the weight dequantized to x.dtype (FP8 emulated: one byte per value kept)."""
    s = scale.to(x.dtype)
    return _dense(x, qweight.to(x.dtype) * (s[:, None] if s.dim() == 1 else s), bias)
