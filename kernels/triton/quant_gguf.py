"""Matmul on GGUF blocks in Triton (CUDA and ROCm): Q4_0 / Q4_1 / Q8_0, Q5_0 / Q5_1, the
K-quants Q4_K / Q5_K / Q6_K, Q2_K and Q3_K, and IQ4_NL and IQ4_XS (their nibbles looked up
in a 16-entry table of levels held in device memory); Q2_K, Q3_K, IQ4_NL and IQ4_XS are
tested under the interpreter only: no platform declares them for Triton until a GPU run has
checked them.
Each program dequantizes a [BLOCK_N, 32] tile of weight
blocks in registers and accumulates ``x_tile @ w_tile^T`` in float32, so the weight is
read once, in its 2.6-8.5 bits.  A K-quant super-block of 256 values is read as 8 pieces
of 32: piece j's 6-bit scale and minimum (Q4_K / Q5_K) or its two int8 scales of 16
values (Q6_K; Q2_K: two 4-bit scales and minimums; Q3_K: two 6-bit scales; IQ4_XS: one 6-bit
scale) are decoded with its quants.

Reference: :func:`pagedserve.kernels.quant_reference.gguf_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant_reference import GGUF_BLOCK_BYTES, GGUF_BLOCK_VALUES, IQ4_NL_VALUES
from pagedserve.kernels.triton._common import FLOAT_DTYPES, next_power_of_2

__all__ = ["gguf_linear_triton"]

_TYPE_CODES = {
    "Q4_0": 0,
    "Q4_1": 1,
    "Q8_0": 2,
    "Q5_0": 3,
    "Q5_1": 4,
    "Q4_K": 5,
    "Q5_K": 6,
    "Q6_K": 7,
    "Q2_K": 8,
    "Q3_K": 9,
    "IQ4_NL": 10,
    "IQ4_XS": 11,
}
#: IQ4_NL's (and IQ4_XS's) levels as float32, one copy per device (read by every launch; others ignore it).
_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(device: torch.device) -> torch.Tensor:
    if device not in _LEVELS:
        _LEVELS[device] = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=device)
    return _LEVELS[device]


@triton.jit
def _half_at(ptr, offs, mask):
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32_at(ptr, offs, mask):
    b0 = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + offs + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + offs + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _kscale(ptr, offs, mask, sub, MINS: tl.constexpr):
    """Q4_K / Q5_K: sub-block ``sub``'s 6-bit scale (or minimum: MINS) from scales[12] at offs."""
    lo = sub < 4
    # Sub-blocks 0-3: low 6 bits of byte sub (scales) / sub + 4 (minimums); 4-7: a nibble
    # of byte sub + 4 (low: scales, high: minimums) below the top bits of byte sub - 4 / sub.
    first = tl.load(ptr + offs + tl.where(lo, sub + 4 * MINS, sub + 4), mask=mask, other=0).to(tl.int32)
    top = tl.load(ptr + offs + tl.where(lo, sub, sub - 4 + 4 * MINS), mask=mask, other=0).to(tl.int32)
    nibble = (first >> (4 * MINS)) & 0xF
    return tl.where(lo, first & 0x3F, nibble | ((top >> 6) << 4)).to(tl.float32)


@triton.jit
def _gguf_linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    levels_ptr,
    M,
    N,
    NB,
    stride_xm,
    row_bytes,
    TYPE: tl.constexpr,
    BB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, NB):
        if TYPE == 10:  # IQ4_NL: 32-value blocks
            base = rn.to(tl.int64) * row_bytes + b * BB  # [BLOCK_N]
        elif TYPE >= 5:  # K-quants: piece `sub` of 32 values of super-block b // 8
            sub = b % 8
            base = rn.to(tl.int64) * row_bytes + (b // 8) * BB  # [BLOCK_N]
        else:
            base = rn.to(tl.int64) * row_bytes + b * BB  # [BLOCK_N]
        if TYPE == 7:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | d
            d = _half_at(w_ptr, base + 208, mask_n)
        elif TYPE == 8:  # Q2_K: scales[16] | qs[64] | d | dmin
            d = _half_at(w_ptr, base + 80, mask_n)
        elif TYPE == 9:  # Q3_K: hmask[32] | qs[64] | scales[12] | d
            d = _half_at(w_ptr, base + 108, mask_n)
        else:
            d = _half_at(w_ptr, base, mask_n)
        if TYPE == 8:
            # Piece sub = 4 h + c: bits 2c of qs[32 h + l]; sub-blocks 2 sub, 2 sub + 1 of 16
            # with scales[r] = 4-bit scale (low nibble) and minimum (high nibble).
            byte = tl.load(w_ptr + base[:, None] + 16 + 32 * (sub // 4) + j[None, :], mask=mask_n[:, None], other=0)
            q = (byte.to(tl.int32) >> (2 * (sub % 4))) & 3
            sb = tl.load(w_ptr + base[:, None] + 2 * sub + j[None, :] // 16, mask=mask_n[:, None], other=0).to(tl.int32)
            dmin = _half_at(w_ptr, base + 82, mask_n)
            w = q.to(tl.float32) * ((sb & 0xF).to(tl.float32) * d[:, None]) - (sb >> 4).to(tl.float32) * dmin[:, None]
        elif TYPE == 7:
            # Piece sub = 4 h + c: low 4 bits in the low (c < 2) or high nibble of
            # ql[64 h + 32 (c % 2) + l], top 2 in bits 2c of qh[32 h + l]; a scale per 16.
            h = sub // 4
            c = sub % 4
            lo = tl.load(w_ptr + base[:, None] + 64 * h + 32 * (c % 2) + j[None, :], mask=mask_n[:, None], other=0)
            hi = tl.load(w_ptr + base[:, None] + 128 + 32 * h + j[None, :], mask=mask_n[:, None], other=0)
            low = (lo.to(tl.int32) >> (4 * (c // 2))) & 0xF
            q = (low | (((hi.to(tl.int32) >> (2 * c)) & 3) << 4)) - 32
            sc = tl.load(w_ptr + base[:, None] + 192 + 2 * sub + j[None, :] // 16, mask=mask_n[:, None], other=0)
            w = q.to(tl.float32) * (sc.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None])
        elif TYPE == 9:
            # Piece sub = 4 n + c: low 2 bits at bits 2c of qs[32 n + l], the third (4) at bit
            # sub of hmask[l], q - 4; scale i = 2 sub + l // 16: the low (i < 8) or high nibble
            # of scales[i % 8] below bits 2 (i // 4) of scales[8 + i % 4], minus 32.
            lo = tl.load(w_ptr + base[:, None] + 32 + 32 * (sub // 4) + j[None, :], mask=mask_n[:, None], other=0)
            hm = tl.load(w_ptr + base[:, None] + j[None, :], mask=mask_n[:, None], other=0)
            q = ((lo.to(tl.int32) >> (2 * (sub % 4))) & 3) + 4 * ((hm.to(tl.int32) >> sub) & 1) - 4
            i = 2 * sub + j // 16
            s_lo = tl.load(w_ptr + base[:, None] + 96 + (i % 8)[None, :], mask=mask_n[:, None], other=0)
            s_hi = tl.load(w_ptr + base[:, None] + 104 + (i % 4)[None, :], mask=mask_n[:, None], other=0)
            sc = ((s_lo.to(tl.int32) >> (4 * (i // 8))[None, :]) & 0xF) | (
                ((s_hi.to(tl.int32) >> (2 * (i // 4))[None, :]) & 3) << 4
            )
            w = q.to(tl.float32) * ((sc - 32).to(tl.float32) * d[:, None])
        elif TYPE == 10:  # IQ4_NL: d | qs[16], the nibbles (placed as Q4_0's) index the levels
            byte = tl.load(w_ptr + base[:, None] + 2 + (j[None, :] % 16), mask=mask_n[:, None], other=0)
            nib = (byte.to(tl.int32) >> ((j[None, :] // 16) * 4)) & 0xF
            w = tl.load(levels_ptr + nib) * d[:, None]
        elif TYPE == 11:
            # IQ4_XS: d | u16 scales_h | scales_l[4] | qs[128]; piece sub's nibbles (placed
            # as IQ4_NL's) in qs[16 sub:16 sub + 16]; its 6-bit scale the nibble sub % 2 of
            # scales_l[sub // 2] below bits 2 sub of scales_h; (d * (ls - 32)) * level.
            byte = tl.load(w_ptr + base[:, None] + 8 + 16 * sub + (j[None, :] % 16), mask=mask_n[:, None], other=0)
            nib = (byte.to(tl.int32) >> ((j[None, :] // 16) * 4)) & 0xF
            s_lo = tl.load(w_ptr + base + 4 + sub // 2, mask=mask_n, other=0).to(tl.int32)
            s_h0 = tl.load(w_ptr + base + 2, mask=mask_n, other=0).to(tl.int32)
            s_h1 = tl.load(w_ptr + base + 3, mask=mask_n, other=0).to(tl.int32)
            ls = ((s_lo >> (4 * (sub % 2))) & 0xF) | ((((s_h0 | (s_h1 << 8)) >> (2 * sub)) & 3) << 4)
            w = tl.load(levels_ptr + nib) * (d * (ls - 32).to(tl.float32))[:, None]
        elif TYPE >= 5:  # Q4_K: d | dmin | scales[12] | qs[128]; Q5_K: ... | qh[32] | qs[128]
            qs_at: tl.constexpr = 48 if TYPE == 6 else 16
            byte = tl.load(w_ptr + base[:, None] + qs_at + 32 * (sub // 2) + j[None, :], mask=mask_n[:, None], other=0)
            q = (byte.to(tl.int32) >> (4 * (sub % 2))) & 0xF
            if TYPE == 6:
                qh = tl.load(w_ptr + base[:, None] + 16 + j[None, :], mask=mask_n[:, None], other=0)
                q = q | (((qh.to(tl.int32) >> sub) & 1) << 4)
            sc = _kscale(w_ptr, base + 4, mask_n, sub, 0)
            mn = _kscale(w_ptr, base + 4, mask_n, sub, 1)
            dmin = _half_at(w_ptr, base + 2, mask_n)
            w = q.to(tl.float32) * (d * sc)[:, None] - (dmin * mn)[:, None]
        elif TYPE == 3 or TYPE == 4:  # Q5_0: d | u32 qh | qs[16]; Q5_1: d | m | u32 qh | qs[16]
            qh_at: tl.constexpr = 4 if TYPE == 4 else 2
            qh = _u32_at(w_ptr, base + qh_at, mask_n)
            byte = tl.load(w_ptr + base[:, None] + qh_at + 4 + (j[None, :] % 16), mask=mask_n[:, None], other=0)
            nib = (byte.to(tl.int32) >> ((j[None, :] // 16) * 4)) & 0xF
            q = nib | (((qh[:, None] >> j[None, :].to(tl.uint32)) & 1).to(tl.int32) << 4)
            if TYPE == 4:
                w = q.to(tl.float32) * d[:, None] + _half_at(w_ptr, base + 2, mask_n)[:, None]
            else:
                w = (q - 16).to(tl.float32) * d[:, None]
        elif TYPE == 2:  # Q8_0: d | int8 q[32]
            q = tl.load(w_ptr + base[:, None] + 2 + j[None, :], mask=mask_n[:, None], other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None]
        else:  # Q4_0: d | qs[16]; Q4_1: d | m | qs[16]; element j < 16 low nibble, else high
            qoff: tl.constexpr = 4 if TYPE == 1 else 2
            byte = tl.load(w_ptr + base[:, None] + qoff + (j[None, :] % 16), mask=mask_n[:, None], other=0)
            q = ((byte >> ((j[None, :] // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
            if TYPE == 1:
                w = q * d[:, None] + _half_at(w_ptr, base + 2, mask_n)[:, None]
            else:
                w = (q - 8.0) * d[:, None]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + b * 32 + j[None, :], mask=mask_m[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def gguf_linear_triton(
    x: torch.Tensor,
    raw: torch.Tensor,
    type_name: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x ``[M, K]`` (float32/bfloat16/float16) @ GGUF rows uint8 ``[N, K/block_values *
    block_bytes]``^T (+ bias ``[N]``) -> ``[M, N]`` in ``out_dtype`` (None: x.dtype; the
    float32 sums are rounded once) (block_values 256 for the K-quants and IQ4_XS, else 32)."""
    if type_name not in _TYPE_CODES:
        raise ValueError(f"gguf_linear_triton: type {type_name!r} unsupported (supported: {', '.join(_TYPE_CODES)})")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"gguf_linear_triton: x must be 2-D float32/bfloat16/float16, got {x.dtype} {tuple(x.shape)}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.device != x.device:
        raise ValueError("gguf_linear_triton: raw must be 2-D uint8 on x's device")
    m, k = x.shape
    bb, per = GGUF_BLOCK_BYTES[type_name], GGUF_BLOCK_VALUES[type_name]
    if k % per or raw.shape[1] != k // per * bb:
        raise ValueError(f"gguf_linear_triton: rows of {raw.shape[1]} bytes do not hold K={k} {type_name} values")
    x = x.contiguous()
    raw = raw.contiguous()
    n = raw.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_linear_kernel[grid](
        x,
        raw,
        y,
        _levels(x.device),
        m,
        n,
        k // 32,
        x.stride(0),
        raw.shape[1],
        TYPE=_TYPE_CODES[type_name],
        BB=bb,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype if out_dtype is None else out_dtype)
