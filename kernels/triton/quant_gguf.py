"""Matmul on GGUF Q4_0 / Q4_1 / Q8_0 blocks in Triton (CUDA and ROCm): each program
dequantizes a [BLOCK_N, 32] tile of weight blocks in registers and accumulates
``x_tile @ w_tile^T`` in float32, so the weight is read once, in its 4.5-8.5 bits.

Reference: :func:`pagedserve.kernels.quant_reference.gguf_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant_reference import GGUF_BLOCK_BYTES
from pagedserve.kernels.triton._common import FLOAT_DTYPES, next_power_of_2

__all__ = ["gguf_linear_triton"]

_TYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@triton.jit
def _half_at(ptr, offs, mask):
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
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
        base = rn.to(tl.int64) * row_bytes + b * BB  # [BLOCK_N]
        d = _half_at(w_ptr, base, mask_n)
        if TYPE == 2:  # Q8_0: d | int8 q[32]
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
    x: torch.Tensor, raw: torch.Tensor, type_name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x ``[M, K]`` (float32/bfloat16/float16) @ GGUF rows uint8 ``[N, K/32 * block_bytes]``^T
    (+ bias ``[N]``) -> ``[M, N]`` in x.dtype."""
    if type_name not in _TYPE_CODES:
        raise ValueError(f"gguf_linear_triton: type {type_name!r} unsupported (supported: {', '.join(_TYPE_CODES)})")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"gguf_linear_triton: x must be 2-D float32/bfloat16/float16, got {x.dtype} {tuple(x.shape)}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.device != x.device:
        raise ValueError("gguf_linear_triton: raw must be 2-D uint8 on x's device")
    m, k = x.shape
    bb = GGUF_BLOCK_BYTES[type_name]
    if k % 32 or raw.shape[1] != k // 32 * bb:
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
    return y.to(x.dtype)
