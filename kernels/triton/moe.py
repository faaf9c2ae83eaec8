"""Triton kernels of the ``fused_moe`` op (CUDA and ROCm); the specification is
:func:`pagedserve.kernels.reference.fused_moe`.

- align (torch, on the device, no host sync): the T*K (token, slot) pairs sorted by
  expert, each expert's rows padded to BLOCK_M, so that every BLOCK_M-row block belongs
  to one expert; ``row_index`` maps block rows to pairs (-1: padding) and
  ``block_expert`` blocks to experts (-1: past the last used block).  The grid is sized
  by the upper bound ceil(T*K / BLOCK_M) + E; blocks past the end exit at once.
- up: one program per (block, BLOCK_N columns of I): gate and up tiles of
  ``x[tokens] @ w13[e]^T`` with tl.dot, rounded to the dtype as the reference's linear,
  then act(gate) (rounded) * up, stored per pair in ``act`` [T*K, I].
- down: one program per (block, BLOCK_N columns of H): ``act[pairs] @ w2[e]^T`` rounded
  to the dtype, stored per pair in ``y`` [T*K, H].
- combine (torch): out[t] = sum_k w[t, k] * y[t, k] in float32, as the reference.

float32 inputs use IEEE dot products (never TF32), so they match the reference to
float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import FLOAT_DTYPES, check_same_device, check_tensor, interpreter_enabled

__all__ = ["fused_moe_triton", "align_by_expert"]

_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2}


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    # GELU, tanh approximation; tanh(z) = 2 / (1 + exp(-2z)) - 1.
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))


@triton.jit
def _gated(g, u, alpha, limit, ACT: tl.constexpr, dtype: tl.constexpr):
    """act(gate) * up from the rounded sums, rounded as the reference rounds in ``dtype``."""
    if ACT == 2:  # swigluoai (GPT-OSS): clamps, then (u + 1) * g * sigmoid(alpha * g)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        ga = (g * alpha).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(dtype).to(tl.float32)
        return (u + 1.0).to(dtype).to(tl.float32) * (g * sig).to(dtype).to(tl.float32)
    return _activate(g, ACT).to(dtype).to(tl.float32) * u


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: float32 products (never TF32); also how the interpreter multiplies 16-bit
    # tiles, which its numpy dot would otherwise misread.  On a GPU 16-bit tiles go to
    # the tensor cores with float32 accumulation (their products are exact in float32).
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _up(
    x_ptr,
    w13_ptr,
    act_ptr,
    row_index_ptr,
    block_expert_ptr,
    b13_ptr,
    H,
    I,  # noqa: E741 (the intermediate size, as in the docstrings)
    alpha,
    limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e < 0:
        return
    pairs = tl.load(row_index_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w13_ptr + e.to(tl.int64) * 2 * I * H
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * H + ks[None, :], mask=valid[:, None] & (ks[None, :] < H), other=0.0)
        wmask = (ks[:, None] < H) & (ns[None, :] < I)
        wg = tl.load(w_base + ns[None, :] * H + ks[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (I + ns[None, :]) * H + ks[:, None], mask=wmask, other=0.0)
        acc_g += _dot(x, wg, IEEE)
        acc_u += _dot(x, wu, IEEE)
    dtype = act_ptr.dtype.element_ty
    if HAS_BIAS:  # added to the float32 sums before the rounding, as a biased linear
        b_base = b13_ptr + e.to(tl.int64) * 2 * I
        acc_g += tl.load(b_base + ns, mask=ns < I, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + I + ns, mask=ns < I, other=0.0).to(tl.float32)[None, :]
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    h = _gated(g, u, alpha, limit, ACT, dtype)
    tl.store(act_ptr + pairs[:, None] * I + ns[None, :], h.to(dtype), mask=valid[:, None] & (ns[None, :] < I))


@triton.jit
def _down(
    act_ptr,
    w2_ptr,
    y_ptr,
    row_index_ptr,
    block_expert_ptr,
    b2_ptr,
    H,
    I,  # noqa: E741 (the intermediate size, as in the docstrings)
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e < 0:
        return
    pairs = tl.load(row_index_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs >= 0
    rows = tl.where(valid, pairs, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w2_ptr + e.to(tl.int64) * H * I
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows[:, None] * I + ks[None, :], mask=valid[:, None] & (ks[None, :] < I), other=0.0)
        w = tl.load(w_base + ns[None, :] * I + ks[:, None], mask=(ks[:, None] < I) & (ns[None, :] < H), other=0.0)
        acc += _dot(a, w, IEEE)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + e.to(tl.int64) * H + ns, mask=ns < H, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + pairs[:, None] * H + ns[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=valid[:, None] & (ns[None, :] < H),
    )


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_index int64 [num_blocks * block_m], block_expert int32 [num_blocks]) for
    topk_ids [T, K]: the pairs (flat index t*K + k) of each expert in consecutive blocks
    of block_m rows, padded with -1; num_blocks = ceil(T*K / block_m) + E (an upper
    bound, so nothing waits for the host), unused blocks' expert -1."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    num_blocks = triton.cdiv(pairs, block_m) + num_experts
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    row_index = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=flat.device)
    row_index[dest] = order
    block_first = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_first, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return row_index, block_expert


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``reference.fused_moe`` in two Triton launches (up, down); ValueError on bad arguments.

    GPT-OSS's experts: ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H] (each a constexpr
    variant) and the "swigluoai" activation with ``alpha`` and ``limit``."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not supported (silu, gelu, swigluoai)")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), contiguous=True)
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), contiguous=True)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int64,))
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if (
        w13.shape[1] != 2 * inter
        or w13.shape[2] != hidden
        or w2.shape != (experts, hidden, inter)
        or topk_ids.shape[0] != tokens
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_moe: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
            f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}"
        )
    for name, b, shape in (("w13_bias", w13_bias, (experts, 2 * inter)), ("w2_bias", w2_bias, (experts, hidden))):
        if b is not None and (tuple(b.shape) != shape or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(f"fused_moe: {name} must be {list(shape)} in x's dtype and device, got {tuple(b.shape)}")
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    block_m, block_n, block_k = 16, 32, 32
    row_index, block_expert = align_by_expert(topk_ids.contiguous(), experts, block_m)
    pairs = tokens * top_k
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or interpreter_enabled()
    num_blocks = block_expert.shape[0]
    _up[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        act,
        row_index,
        block_expert,
        x if w13_bias is None else w13_bias,  # unused without a bias
        hidden,
        inter,
        float(alpha),
        float(limit),
        TOP_K=top_k,
        ACT=_ACTIVATIONS[activation],
        HAS_BIAS=w13_bias is not None,
        IEEE=ieee,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    _down[(num_blocks, triton.cdiv(hidden, block_n))](
        act,
        w2,
        y,
        row_index,
        block_expert,
        x if w2_bias is None else w2_bias,  # unused without a bias
        hidden,
        inter,
        HAS_BIAS=w2_bias is not None,
        IEEE=ieee,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    out = (y.view(tokens, top_k, hidden).float() * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)
