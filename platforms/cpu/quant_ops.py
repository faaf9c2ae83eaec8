"""The CPU platform's quantized linear ops (their contracts: pagedserve.kernels.reference).

- ``gguf_linear``: the native kernel of kernels/cpu/quant_gguf.cpp (int8 activations per
  32-value block, VNNI/AVX2 dot products; Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks in
  kernels/cpu/quant_gguf_kquant.cpp, declared by the ``GGUF_EXTENDED`` capability, and
  Q2_K, Q3_K, IQ4_NL and IQ4_XS in kernels/cpu/quant_gguf_q2k.cpp, quant_gguf_q3k.cpp,
  quant_gguf_iq4nl.cpp and quant_gguf_iq4xs.cpp, each declared by its ``gguf_type:NAME``
  capability, so that a .gguf keeps them) where it builds and loads, at every row count:
  each row's result is then independent of the other rows, so a greedy request answers
  the same whatever else is in its batch (docs/quantization.md).
  ``PAGEDSERVE_QUANT_CPU_KERNELS=0`` keeps the reference.
- ``prepare_gguf_weight``: where the kernel has its tiled AVX-512 VNNI GEMM, Q4_0/Q4_1/
  Q5_0/Q5_1/Q8_0/IQ4_NL blocks of a multiple of 16 rows are repacked for it once at load
  (kernels/cpu/quant_gguf_packed.cpp: 16 output columns interleaved per 4 k, scales
  beside them; Q4_K, Q5_K and Q6_K likewise in kernels/cpu/quant_gguf_kpacked.cpp,
  Q2_K, Q3_K and IQ4_XS in kernels/cpu/quant_gguf_q2k.cpp, quant_gguf_q3k.cpp and
  quant_gguf_iq4xs.cpp, the file's size exactly); ``gguf_linear`` then runs the tiled
  kernel on them.  Other weights keep the row kernel.  ``PAGEDSERVE_CPU_GGUF_REPACK=0``
  keeps the file's blocks.
- ``gguf_embedding``: rows of repacked blocks (a tied embedding shares its LM head's
  repacked weight): only those rows are unpacked (``unpack_rows``), then dequantized.
- ``gguf_linear_silu_and_mul``: where the tiled kernel has its gated variant, a gated
  MLP's [gate; up] weight repacked as above (the 32-value types, and the K-quants Q2_K-Q6_K
  and IQ4_XS where ``has_kpacked_gated``) runs in one pass that writes silu(gate) * up (rounded bit
  for bit as ``silu_and_mul(gguf_linear(...))``), never the [M, 2d] intermediate; other
  weights and inputs take the registry's two ops.
- ``gguf_linear_stacked``: a fused projection whose parts keep different block types (a
  Q5_K_M's [q; k] Q5_1 beside a Q8_0 v, a Q4_K_M's [q; k] Q4_K beside a Q6_K v, 32-value
  and K-quant or IQ4_XS parts together), repacked as above, in one native call (activations
  quantized once per format, one parallel region, each part's columns written in place);
  other parts take ``gguf_linear`` once per part.
- With ``CpuOptions.gguf_amx`` (off by default) and AMX int8 on the CPU, repacked
  Q4_0/Q4_1/Q8_0 weights at ``GGUF_AMX_MIN_ROWS`` rows or more run on AMX tiles
  (kernels/cpu/quant_gguf_amx.cpp; the same packed weight, bit for bit the tiled VNNI
  kernel's result, so a row's result still depends on that row alone).
- ``int8_linear``: aten's CPU int8 weight-only kernel ``torch._weight_int8pack_mm``.
- ``w8a8_linear``: ``torch._int_mm`` (oneDNN, VNNI where the CPU has it).
- ``fp8_linear``: emulated, the weight dequantized to x's dtype for each matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedserve.kernels import quant_reference as qref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu.quant_gguf_amx import load_gguf_amx
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.ops import GGUF_EXTENDED, GGUF_OUT_DTYPE, PREFERS_QUANTIZED, OpRegistry
from pagedserve.platforms.options import CpuOptions

if TYPE_CHECKING:
    from pagedserve.platforms.cpu.tuning import Tuner

__all__ = [
    "register_cpu_quant_ops",
    "gguf_linear",
    "make_gguf_linear_silu_and_mul",
    "make_gguf_linear_stacked",
    "prepare_gguf_weight",
    "gguf_embedding",
    "unpack_gguf_weight",
    "int8_linear",
    "w8a8_linear",
    "CPU_DENSE_MIN_ROWS",
    "GGUF_AMX_MIN_ROWS",
    "make_gguf_linear_amx",
]

#: Rows of x from which gguf_linear would dequantize the weight and run one dense matmul
#: instead of the int8 kernel (faster prefill). None: never, because the two methods round
#: differently and a request's tokens then depended on how many rows shared its step
#: (benchmarks/batch_invariance.py measures both).
CPU_DENSE_MIN_ROWS: int | None = None
#: Rows from which the AMX int8 kernel runs repacked weights (a static crossover measured
#: on the default model's shapes, one thread: below it the VNNI kernel is faster, by 4-10x
#: at 1-4 rows; docs/kernels_cpu.md "AMX int8 GGUF").
GGUF_AMX_MIN_ROWS = 128
#: Activation dtypes the native kernels take (others go to the reference or a dense path).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
#: Block types the tiled kernel takes repacked (the others keep the file's blocks); the
#: gated kernel takes the 32-value types (GATED_TYPES), the K-quants only where the build
#: has their tiled kernel (kernels/cpu/quant_gguf_kpacked.cpp, quant_gguf_q2k.cpp,
#: quant_gguf_q3k.cpp, quant_gguf_iq4xs.cpp: ``has_kpacked``) and, for the gated op, its
#: gated variant (``has_kpacked_gated``).
GATED_TYPES = (*qref.GGUF_BASE_TYPES, "Q5_0", "Q5_1", "IQ4_NL")
KPACKED_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")
PACKED_TYPES = (*GATED_TYPES, *KPACKED_TYPES)
#: Types one native stacked call takes as parts (every repacked type: a part's weight is
#: 3-d only where the build has its tiled kernel).
STACKED_TYPES = PACKED_TYPES
#: ggml type ids by name (the kernels' ``type`` argument).
_TYPE_IDS = qref.GGUF_TYPE_IDS
#: Types of ``qref.GGUF_OPTIONAL_TYPES`` the native kernel takes (every build: a row
#: kernel; the tiled one on repacked blocks where AVX-512 VNNI is built).
NATIVE_OPTIONAL_TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
#: What every native ``gguf_linear`` registered here declares.
_GGUF_CAPABILITIES = (
    PREFERS_QUANTIZED,
    GGUF_EXTENDED,
    GGUF_OUT_DTYPE,
    *(qref.gguf_type_capability(t) for t in NATIVE_OPTIONAL_TYPES),
)


def gguf_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    type_name: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``reference.gguf_linear`` through the native kernel (registered only where it loads);
    ``data`` may also be repacked by :func:`prepare_gguf_weight` (uint8 ``[N/16, K/32, 16 *
    block_bytes]``), which only the native kernel reads.  ``out_dtype`` float32: the
    kernel writes its float32 sums unrounded (``float32_out``)."""
    dtype = x.dtype
    type_id = _TYPE_IDS.get(type_name)
    if (
        type_id is not None
        and (dtype is torch.bfloat16 or dtype is torch.float32)
        and (out_dtype is None or out_dtype is dtype or out_dtype is torch.float32)
        and x.dim() == 2
        and CPU_DENSE_MIN_ROWS is None
    ):
        # Every linear of a decode step (121 calls at batch 1): the kernel returns [M, N]
        # in x's dtype (or float32), so the reshapes and the cast below would be no-ops at
        # ~0.8 us each.  (dtypes are singletons: ``is`` tests them in a few ns.)
        return load_quant_kernels().gguf_linear_out(
            x, data, type_id, bias, out_dtype is torch.float32 and dtype is not out_dtype
        )
    packed = data.dim() == 3
    out = dtype if out_dtype is None else out_dtype
    if not packed and (x.dtype not in _NATIVE_DTYPES or x.dim() != 2 or type_name not in qref.GGUF_TYPE_IDS):
        return reference.gguf_linear(x, data, type_name, bias, out_dtype)
    if CPU_DENSE_MIN_ROWS is not None and x.shape[0] >= CPU_DENSE_MIN_ROWS:
        y = qref.gguf_linear_dense(x, unpack_gguf_weight(data, type_name) if packed else data, type_name, bias)
        return y.to(out)
    x2 = x.reshape(-1, x.shape[-1])
    # Bias added to the float32 sum and rounded once to x's dtype inside the kernel.
    y = load_quant_kernels().gguf_linear_out(
        x2 if x2.dtype in _NATIVE_DTYPES else x2.float(),
        data,
        qref.GGUF_TYPE_IDS[type_name],
        bias,
        out == torch.float32,
    )
    return y.to(out).reshape(*x.shape[:-1], y.shape[-1])


def _float32_input(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """x for a kernel without an output dtype of its own asked for float32 output: a float32
    copy of x (the same values, so the same int8 activation blocks), whose result is float32."""
    return x.float() if out_dtype == torch.float32 and x.dtype != torch.float32 else x


def make_gguf_linear_amx(linear: Callable[..., torch.Tensor], amx) -> Callable[..., torch.Tensor]:
    """``gguf_linear`` that sends repacked weights at ``GGUF_AMX_MIN_ROWS`` rows or more
    to the AMX module ``amx`` (:func:`load_gguf_amx`), everything else to ``linear``."""

    def gguf_linear_amx(
        x: torch.Tensor,
        data: torch.Tensor,
        type_name: str,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """See reference.gguf_linear; ``data`` may be packed by ``prepare_gguf_weight``."""
        if (
            data.dim() == 3
            and x.dim() == 2
            and x.shape[0] >= GGUF_AMX_MIN_ROWS
            and x.dtype in _NATIVE_DTYPES
            and type_name in qref.GGUF_BASE_TYPES
            and out_dtype in (None, x.dtype, torch.float32)
        ):
            return amx.gguf_linear_out(_float32_input(x, out_dtype), data, qref.GGUF_TYPE_IDS[type_name], bias)
        return linear(x, data, type_name, bias, out_dtype)

    return gguf_linear_amx


def make_gguf_linear_silu_and_mul(
    linear: Callable[..., torch.Tensor],
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    amx_rows: bool = False,
) -> Callable[..., torch.Tensor]:
    """``gguf_linear_silu_and_mul`` that runs [gate; up] weights repacked by
    :func:`prepare_gguf_weight` through the gated tiled kernel, anything else through
    ``silu_and_mul(linear(...))`` (the registry's ``gguf_linear`` and ``silu_and_mul``).
    ``amx_rows``: calls of ``GGUF_AMX_MIN_ROWS`` rows or more on the AMX kernel's types take
    ``linear`` (the AMX kernel there; the gated kernel rounds bit for bit as the two ops in
    sequence)."""
    module = load_quant_kernels()
    # The K-quants whose tiled kernel has its gated variant in this build.
    kgated = {t for t in KPACKED_TYPES if module.has_kpacked_gated(_TYPE_IDS[t])}

    def gguf_linear_silu_and_mul(
        x: torch.Tensor, data: torch.Tensor, type_name: str, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See reference.gguf_linear_silu_and_mul; ``data`` may be packed by ``prepare_gguf_weight``."""
        dtype = x.dtype
        if (
            (type_name in GATED_TYPES or type_name in kgated)
            and (dtype is torch.bfloat16 or dtype is torch.float32)
            and data.dim() == 3
            and data.shape[0] % 2 == 0
            and x.dim() == 2
            and CPU_DENSE_MIN_ROWS is None
            and not (amx_rows and x.shape[0] >= GGUF_AMX_MIN_ROWS and type_name in qref.GGUF_BASE_TYPES)
        ):
            return module.gguf_linear_silu_out(x, data, _TYPE_IDS[type_name], bias)
        return silu_and_mul(linear(x, data, type_name, bias))

    return gguf_linear_silu_and_mul


def make_gguf_linear_stacked(
    linear: Callable[..., torch.Tensor], amx_rows: bool = False
) -> Callable[..., torch.Tensor]:
    """``gguf_linear_stacked`` that runs parts all repacked by :func:`prepare_gguf_weight`
    (a Q5_K_M's [q; k] Q5_1 beside a Q8_0 v, a Q4_K_M's [q; k] Q4_K beside a Q6_K v, any mix
    of the 32-value types and the K-quants) as one native call: the activations quantized
    once per format (every type reads the same int8 blocks but Q4_1, whose activation sums
    are rounded to fp16), one parallel region, each part writing its columns of the output
    in place (bit for bit the parts' ``gguf_linear`` results side by side).  Other parts
    and, with ``amx_rows``, calls of ``GGUF_AMX_MIN_ROWS`` rows or more with a part of the
    AMX kernel's types take ``linear`` (the registry's ``gguf_linear``) once per part."""
    module = load_quant_kernels()

    def gguf_linear_stacked(
        x: torch.Tensor,
        data: list[torch.Tensor],
        type_names: list[str],
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """See reference.gguf_linear_stacked; ``data`` may be packed by ``prepare_gguf_weight``."""
        out = x.dtype if out_dtype is None else out_dtype
        if (
            x.dim() == 2
            and x.dtype in _NATIVE_DTYPES
            and out in (x.dtype, torch.float32)
            and CPU_DENSE_MIN_ROWS is None
            and all(d.dim() == 3 for d in data)
            and all(t in STACKED_TYPES for t in type_names)
            and not (
                amx_rows and x.shape[0] >= GGUF_AMX_MIN_ROWS and any(t in qref.GGUF_BASE_TYPES for t in type_names)
            )
        ):
            ids = [qref.GGUF_TYPE_IDS[t] for t in type_names]
            return module.gguf_linear_multi_out(x, list(data), ids, bias, out != x.dtype)
        ys, at = [], 0
        for d, t in zip(data, type_names):
            n = d.numel() // qref.gguf_row_bytes(t, x.shape[-1])
            ys.append(linear(x, d, t, None if bias is None else bias[at : at + n], out_dtype))
            at += n
        return torch.cat(ys, dim=-1)

    return gguf_linear_stacked


def prepare_gguf_weight(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """See reference.prepare_gguf_weight: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL (and Q2_K-Q6_K, IQ4_XS) CPU
    blocks of a multiple of 16 rows -> the tiled kernel's packed layout (where this build has it); else
    ``data``."""
    module = load_quant_kernels()
    if (
        module is None
        or not module.has_packed()
        or type_name not in PACKED_TYPES
        or (type_name in KPACKED_TYPES and not module.has_kpacked(qref.GGUF_TYPE_IDS[type_name]))
        or data.dim() != 2
        or data.dtype != torch.uint8
        or data.device.type != "cpu"
        or data.shape[0] == 0
        or data.shape[0] % 16
    ):
        return data
    return module.pack_weight(data, qref.GGUF_TYPE_IDS[type_name])


def unpack_gguf_weight(packed: torch.Tensor, type_name: str) -> torch.Tensor:
    """The inverse of :func:`prepare_gguf_weight`'s repacking: uint8 ``[N/16, K/32, 16 *
    block_bytes]`` -> the file's blocks uint8 ``[N, K/32 * block_bytes]``."""
    if type_name in KPACKED_TYPES:
        return _unpack_kquant(packed, type_name)
    g, nb, _ = packed.shape
    bb = qref.GGUF_BLOCK_BYTES[type_name]
    qb = 512 if type_name == "Q8_0" else 256
    entry = packed.reshape(g, nb, 16 * bb)
    if type_name == "Q8_0":
        # [8 lines][16 columns][4 k] of value + 128 -> [column][k = 4 * line + t]
        q = (entry[..., :qb].reshape(g, nb, 8, 16, 4) ^ 0x80).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, 32)
    elif type_name in ("Q5_0", "Q5_1"):
        # [4 lines][16 columns][4 t]: the 5-bit value at k = 8p + t in bits 3-7, bits 0-2 of
        # the one at k = 8p + 4 + t in bits 0-2 (its bits 3-4: bits 2p, 2p+1 of the top
        # bytes after the scales and Q5_1's minimums).
        heads = 64 if type_name == "Q5_1" else 32
        lines = entry[..., :qb].reshape(g, nb, 4, 16, 4)
        top = entry[..., qb + heads : qb + heads + 64].reshape(g, nb, 1, 16, 4)
        p2 = torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1, 1)
        vals = torch.stack([lines >> 3, (lines & 7) | (((top >> p2) & 3) << 3)], dim=3)  # [g, nb, 4, 2, 16, 4]
        v = vals.permute(0, 4, 1, 2, 3, 5).reshape(g, 16, nb, 32)
        q = (v[..., :16] & 0x0F) | ((v[..., 16:] & 0x0F) << 4)
        shifts = torch.arange(8, dtype=torch.uint8)
        qh = ((v >> 4).reshape(g, 16, nb, 4, 8) << shifts).sum(-1, dtype=torch.uint8)  # bit k % 8 of byte k // 8
        dm = entry[..., qb : qb + heads].reshape(g, nb, heads // 32, 16, 2).permute(0, 3, 1, 2, 4)
        return torch.cat([dm.reshape(g, 16, nb, heads // 16), qh, q], dim=-1).reshape(g * 16, nb * bb)
    else:
        # Q4_0 / Q4_1 / IQ4_NL (Q4_0's entries):
        # [4 lines][16 columns][4 t]: low nibble k = 8p + t, high nibble k = 8p + 4 + t
        lines = entry[..., :qb].reshape(g, nb, 4, 16, 4)
        vals = torch.stack([lines & 0x0F, lines >> 4], dim=3)  # [g, nb, 4, 2, 16, 4]
        v = vals.permute(0, 4, 1, 2, 3, 5).reshape(g, 16, nb, 32)
        q = v[..., :16] | (v[..., 16:] << 4)
    scales = entry[..., qb:].reshape(g, nb, -1, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, -1)
    blocks = torch.cat([scales, q], dim=-1)  # d (and m) first, then the quants, as ggml stores them
    return blocks.reshape(g * 16, nb * bb)


def gguf_embedding(ids: torch.Tensor, data: torch.Tensor, type_name: str, dtype: torch.dtype) -> torch.Tensor:
    """See reference.gguf_embedding: rows of the file's blocks, or of their repacked form
    (only the rows ``ids`` are unpacked, by the kernel module's ``unpack_rows``), dequantized."""
    if data.dim() != 3:
        return reference.gguf_embedding(ids, data, type_name, dtype)
    blocks = load_quant_kernels().unpack_rows(data, qref.GGUF_TYPE_IDS[type_name], ids.long())
    return qref.dequantize_gguf(blocks, type_name).to(dtype)


def _fifth_bit_bytes(fifth: torch.Tensor) -> torch.Tensor:
    """uint8 ``[g, n, 64]``: a Q5_K sub-block's fifth bits as its tiled kernel stores them (bit j
    of byte 4c + t: column c at k = 4j + t) -> ``[g, 16, n, 4]``, value k of column c as
    bit k % 8 of byte k // 8 (a little-endian uint32 per column: Q5_x's qh)."""
    g, n = fifth.shape[:2]
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (fifth.reshape(g, n, 16, 1, 4) >> shifts.view(8, 1)) & 1  # [g, n, c, j, t]: k = 4j + t
    bits = bits.reshape(g, n, 16, 4, 8).permute(0, 2, 1, 3, 4)  # [g, c, n, k // 8, k % 8]
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def _unpack_nibble_lines(lines: torch.Tensor) -> torch.Tensor:
    """uint8 ``[g, nsb, 8, 256]`` sub-blocks of nibble lines (4 lines of 64 bytes, byte
    4c+t of line p: column c at k = 8p+t low, 8p+4+t high) -> ``[g, 16, nsb, 8, 32]``."""
    g, nsb = lines.shape[:2]
    v = lines.reshape(g, nsb, 8, 4, 16, 4)
    vals = torch.stack([v & 0x0F, v >> 4], dim=4)  # [g, nsb, sub, p, h, c, t]
    return vals.permute(0, 5, 1, 2, 3, 4, 6).reshape(g, 16, nsb, 8, 32)


def _unpack_q3_k(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K entries (kernels/cpu/quant_gguf_q3k.cpp: per sub-block three lines V0-V2 of 64
    bytes, byte 4c+t of column c; the q of line L, at k = 4L + t, in bits 3 (L % 2) of V[L // 2]
    for L < 6, lines 6 and 7 in bits 6-7 of V0 / V1 with their third bit at bit L of V2; then
    the scales[12] transposed and 16 fp16 d) -> the file's blocks."""
    g, nsb, _ = packed.shape
    v = packed[..., :1536].reshape(g, nsb, 8, 3, 16, 4).long()  # [g, nsb, sub, V, c, t]
    v0, v1, v2 = v[..., 0, :, :], v[..., 1, :, :], v[..., 2, :, :]
    lines = [v0 & 7, (v0 >> 3) & 7, v1 & 7, (v1 >> 3) & 7, v2 & 7, (v2 >> 3) & 7]
    lines += [(v0 >> 6) | (((v2 >> 6) & 1) << 2), (v1 >> 6) | ((v2 >> 7) << 2)]
    q = torch.stack(lines, dim=-2).permute(0, 3, 1, 2, 4, 5)  # [g, c, nsb, sub, L, t]
    q = q.reshape(g, 16, nsb, 2, 4, 32)  # value 128n + 32j + l
    qs = ((q & 3) << (2 * torch.arange(4)).view(4, 1)).sum(-2)  # [.., n, l]: bits 2j of qs[32n + l]
    hm = ((q >> 2).reshape(g, 16, nsb, 8, 32) << torch.arange(8).view(8, 1)).sum(-2)  # bit 4n + j of hmask[l]
    sc = packed[..., 1536:1728].reshape(g, nsb, 12, 16).permute(0, 3, 1, 2)
    d = packed[..., 1728:].reshape(g, nsb, 16, 2).permute(0, 2, 1, 3)
    quants = torch.cat([hm, qs.reshape(g, 16, nsb, 64)], dim=-1).to(torch.uint8)
    return torch.cat([quants, sc, d], dim=-1).reshape(g * 16, nsb * 110)


def _unpack_kquant(packed: torch.Tensor, type_name: str) -> torch.Tensor:
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS entries (kernels/cpu/quant_gguf_kpacked.cpp,
    quant_gguf_q2k.cpp, quant_gguf_q3k.cpp, quant_gguf_iq4xs.cpp) -> the file's blocks."""
    if type_name == "Q3_K":
        return _unpack_q3_k(packed)
    if type_name == "IQ4_XS":
        return _unpack_iq4_xs(packed)
    g, nsb, _ = packed.shape
    if type_name == "Q2_K":
        return _unpack_q2_k(packed)
    if type_name in ("Q4_K", "Q5_K"):
        sb = 256 if type_name == "Q4_K" else 320
        subs = packed[..., : 8 * sb].reshape(g, nsb, 8, sb)
        q = _unpack_nibble_lines(subs[..., :256].contiguous())  # 0..15
        pairs = q.reshape(g, 16, nsb, 4, 2, 32)
        qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(g, 16, nsb, 128)
        tail = packed[..., 8 * sb :]
        d = tail[..., :64].reshape(g, nsb, 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nsb, 4)  # d, dmin
        sc = tail[..., 64:].reshape(g, nsb, 12, 16).permute(0, 3, 1, 2)
        if type_name == "Q4_K":
            return torch.cat([d, sc, qs], dim=-1).reshape(g * 16, nsb * 144)
        # Sub-block j's fifth bits -> bit j of qh[l].
        bits = _fifth_bit_bytes(subs[..., 256:].reshape(g, nsb * 8, 64).contiguous())  # [g, 16, nsb * 8, 4]
        shifts = torch.arange(8, dtype=torch.uint8)
        fifth = (bits.reshape(g, 16, nsb, 8, 4, 1) >> shifts) & 1  # [g, 16, nsb, j, l // 8, l % 8]
        qh = (fifth.reshape(g, 16, nsb, 8, 32) << shifts.view(8, 1)).sum(-2, dtype=torch.uint8)
        return torch.cat([d, sc, qh, qs], dim=-1).reshape(g * 16, nsb * 176)
    subs = packed[..., :3072].reshape(g, nsb, 8, 384)
    low = _unpack_nibble_lines(subs[..., :256].contiguous())
    top = subs[..., 256:].reshape(g, nsb, 8, 2, 16, 4, 1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    top = (top & 3).permute(0, 4, 1, 2, 3, 6, 5).reshape(g, 16, nsb, 8, 32)  # [.., sub, half, i, t]
    q = (low | (top << 4)).reshape(g, 16, nsb, 2, 4, 32)  # values 128h + 32c + l
    ql = (q[..., 0:2, :] & 0x0F) | ((q[..., 2:4, :] & 0x0F) << 4)  # [.., h, c % 2, l]
    qh = ((q >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)).sum(-2, dtype=torch.uint8)
    tail = packed[..., 3072:]
    sc = tail[..., :256].reshape(g, nsb, 16, 16).permute(0, 3, 1, 2)
    d = tail[..., 256:].reshape(g, nsb, 16, 2).permute(0, 2, 1, 3)
    blocks = torch.cat([ql.reshape(g, 16, nsb, 128), qh.reshape(g, 16, nsb, 64), sc, d], dim=-1)
    return blocks.reshape(g * 16, nsb * 210)


def _unpack_iq4_xs(packed: torch.Tensor) -> torch.Tensor:
    """IQ4_XS entries (kernels/cpu/quant_gguf_iq4xs.cpp: per sub-block Q4_K's 4 nibble lines,
    then 16 fp16 d, 16 uint16 scales_h and scales_l[4] transposed) -> the file's blocks
    (d | scales_h | scales_l[4] | qs[128], sub-block j's nibbles in qs[16j:16j + 16])."""
    g, nsb, _ = packed.shape
    q = _unpack_nibble_lines(packed[..., :2048].reshape(g, nsb, 8, 256).contiguous())  # [g, 16, nsb, 8, 32]
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(g, 16, nsb, 128)
    halves = packed[..., 2048:2112].reshape(g, nsb, 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nsb, 4)
    low = packed[..., 2112:].reshape(g, nsb, 4, 16).permute(0, 3, 1, 2)
    return torch.cat([halves, low, qs], dim=-1).reshape(g * 16, nsb * 136)


def _unpack_q2_k(packed: torch.Tensor) -> torch.Tensor:
    """Q2_K entries (16 lines of 64 bytes: byte 4c + t of line r holds in bits 2i, 2i+1
    column c's q at k = 16r + 4i + t; then scales[16] transposed, 16 d, 16 dmin) -> the
    file's blocks (scales[16] | qs[64] | d | dmin)."""
    g, nsb, _ = packed.shape
    two = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    lines = packed[..., :1024].reshape(g, nsb, 16, 1, 16, 4)  # [g, s, r, 1, c, t]
    q = ((lines >> two.view(4, 1, 1)) & 3).permute(0, 4, 1, 2, 3, 5).reshape(g, 16, nsb, 2, 4, 32)  # k = 128h + 32j + l
    qs = (q << two.view(4, 1)).sum(-2, dtype=torch.uint8)  # [g, c, s, h, l]: bits 2j of qs[32h + l]
    sc = packed[..., 1024:1280].reshape(g, nsb, 16, 16).permute(0, 3, 1, 2)
    dm = packed[..., 1280:].reshape(g, nsb, 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nsb, 4)
    return torch.cat([sc, qs.reshape(g, 16, nsb, 64), dm], dim=-1).reshape(g * 16, nsb * 84)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference.int8_linear`` through ``torch._weight_int8pack_mm`` (scales per output channel)."""
    if x.dtype not in _NATIVE_DTYPES or x.dim() != 2:
        return qref.int8_linear_dense(x, qweight, scale, bias)
    y = torch._weight_int8pack_mm(x.contiguous(), qweight, scale.to(x.dtype))
    return y if bias is None else y + bias.to(y.dtype)


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference.w8a8_linear`` with the integer products in ``torch._int_mm``."""
    xq, xs = qref.quantize_per_token_int8(x)
    # A transposed view of the [N, K] rows is what oneDNN reads fastest (benchmarks/quantization.py).
    acc = torch._int_mm(xq, qweight.t())
    y = acc.float() * xs * scale.float()[None, :]
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def register_cpu_quant_ops(ops: OpRegistry, options: CpuOptions | None = None, tuner: Tuner | None = None) -> None:
    """Install the CPU's quantized linear ops into ``ops`` (see the module docstring).

    Loads the native GGUF kernel, compiling it on first use; where it is switched off
    (``options.quant_kernels``; None: the environment now) or cannot be built,
    ``gguf_linear`` stays the reference (the loader has warned why).  With a ``tuner``
    (tuning on), ``options.gguf_amx_bf16`` and AMX on the CPU, repacked weights are
    dispatched per row-count bucket between the VNNI kernel and the AMX-BF16 one by
    measurement (platforms/cpu/tuned_gguf.py).
    """
    options = CpuOptions.from_env() if options is None else options
    module = load_quant_kernels() if options.quant_kernels else None
    if module is not None:
        # The measured decode win (docs/quantization.md, "Default on CPU"): .gguf weights
        # stay in blocks by default where this kernel runs.
        source = f"cpu-native-quant({module.isa()})"
        repack = module.has_packed() and options.gguf_repack
        tuned_amx = tuner is not None and options.gguf_amx_bf16
        amx = load_gguf_amx() if repack and (options.gguf_amx or tuned_amx) else None
        if amx is not None and tuned_amx:
            from pagedserve.platforms.cpu.tuned_gguf import TunedGguf

            static_gated = make_gguf_linear_silu_and_mul(gguf_linear, ops.get("silu_and_mul"))
            tuned = TunedGguf(
                tuner, module, amx, prepare_gguf_weight, gguf_linear, static_gated, amx_int8=options.gguf_amx
            )
            tsource = f"{source}+tuned(" + ",".join(sorted(tuned.kernels)) + ")"
            ops.register("gguf_linear", tuned.gguf_linear, source=tsource, capabilities=_GGUF_CAPABILITIES)
            ops.register("prepare_gguf_weight", tuned.prepare_op(), source=tsource)
            ops.register("gguf_embedding", gguf_embedding, source=source)
            if module.has_packed_gated():
                ops.register("gguf_linear_silu_and_mul", tuned.gguf_linear_silu_and_mul, source=tsource)
        else:
            if amx is not None:
                linear = make_gguf_linear_amx(gguf_linear, amx)
                ops.register("gguf_linear", linear, source=f"{source}+amx-int8", capabilities=_GGUF_CAPABILITIES)
            else:
                ops.register("gguf_linear", gguf_linear, source=source, capabilities=_GGUF_CAPABILITIES)
            if repack:
                ops.register("prepare_gguf_weight", prepare_gguf_weight, source=source)
                ops.register("gguf_embedding", gguf_embedding, source=source)
                if module.has_packed_gated():
                    fused = make_gguf_linear_silu_and_mul(
                        ops.get("gguf_linear"), ops.get("silu_and_mul"), amx_rows=amx is not None
                    )
                    ops.register("gguf_linear_silu_and_mul", fused, source=source)
                stacked = make_gguf_linear_stacked(ops.get("gguf_linear"), amx_rows=amx is not None)
                ops.register("gguf_linear_stacked", stacked, source=source)
    ops.register("int8_linear", int8_linear, source="torch")
    ops.register("w8a8_linear", w8a8_linear, source="torch")
    ops.register("fp8_linear", qref.fp8_linear_dense, source="torch")
