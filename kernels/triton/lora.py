"""Triton kernels of the batched multi-LoRA op (Punica-style shrink and expand); the
specification is :func:`pagedserve.kernels.lora_reference.lora_linear`.

- shrink: one program per row; ``t[row] = lora_a[slot] @ x[row]`` in float32, over
  ``in`` in BLOCK_K chunks (rows without an adapter exit at once);
- expand: one program per (row, BLOCK_N output columns);
  ``y[row, cols] += (lora_b[slot, cols] @ t[row])`` rounded to y's dtype, as the
  reference adds it.  ``y`` may be strided (a column slice of a fused output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2

__all__ = ["lora_linear_triton"]


@triton.jit
def _shrink(
    x_ptr, a_ptr, slots_ptr, t_ptr, K, R, stride_x, stride_as, stride_ar, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :],
            mask=(rs[:, None] < R) & (ks[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + row * BLOCK_R + rs, acc)


@triton.jit
def _expand(
    y_ptr,
    b_ptr,
    slots_ptr,
    t_ptr,
    N,
    R,
    stride_y0,
    stride_y1,
    stride_bs,
    stride_bn,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + row * BLOCK_R + rs)
    b = tl.load(
        b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :],
        mask=(ns[:, None] < N) & (rs[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1)
    ptrs = y_ptr + row * stride_y0 + ns * stride_y1
    y = tl.load(ptrs, mask=ns < N)
    out = y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)
    tl.store(ptrs, out.to(y.dtype), mask=ns < N)


def lora_linear_triton(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``reference.lora_linear`` in two Triton launches; ValueError on bad arguments."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("x", x, ndim=2, dtypes=(y.dtype,), last_dim_contiguous=True)
    check_tensor("lora_a", lora_a, ndim=3, dtypes=(y.dtype,), last_dim_contiguous=True)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(y.dtype,), last_dim_contiguous=True)
    check_tensor("token_slots", token_slots, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_same_device(y=y, x=x, lora_a=lora_a, lora_b=lora_b, token_slots=token_slots)
    n, k = x.shape
    slots, r, _ = lora_a.shape
    out = y.shape[1]
    if y.shape[0] != n or token_slots.shape[0] != n or lora_a.shape[2] != k or lora_b.shape != (slots, out, r):
        raise ValueError(
            f"lora_linear: shapes do not fit: y {tuple(y.shape)}, x {tuple(x.shape)}, "
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, token_slots {n}"
        )
    if n == 0:
        return y
    block_r = max(16, next_power_of_2(r))
    t = torch.empty(n, block_r, dtype=torch.float32, device=x.device)
    _shrink[(n,)](
        x, lora_a, token_slots, t, k, r, x.stride(0), lora_a.stride(0), lora_a.stride(1), BLOCK_R=block_r, BLOCK_K=64
    )
    block_n = 64
    _expand[(n, triton.cdiv(out, block_n))](
        y,
        lora_b,
        token_slots,
        t,
        out,
        r,
        y.stride(0),
        y.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return y
