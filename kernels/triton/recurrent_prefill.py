"""Prefill (varlen) kernels of the recurrent layers in Triton: any number of tokens per sequence.

The signatures and semantics are those of :mod:`pagedserve.kernels.recurrent_reference`:
the tokens of all sequences flattened, ``query_start_loc`` (int32 ``[num_seqs + 1]``, on
the device) marking each sequence's slice, one float32 state per sequence updated in
place.  Nothing here reads ``query_start_loc`` on the host: the grids are sized from the
tensors' shapes and each program finds its sequence's bounds on the device, so a launch
never waits for the GPU.

- ``causal_conv1d``: the convolution is parallel over tokens, so one program takes a
  tile of ``BLOCK_T`` tokens of one sequence by ``BLOCK_C`` channels, reading the inputs
  before the sequence's start from its cached window (zeros without ``has_state``).
  The token tiles of all sequences share one grid axis of ``num_tokens // BLOCK_T +
  num_seqs`` entries: sequence ``i``'s tiles start at ``query_start_loc[i] // BLOCK_T + i``
  (the numbering of the paged-attention kernel's query blocks), found by a binary search
  over the sequences.  A second launch writes each sequence's new window (its last
  ``width - 1`` inputs), after every tile has read the old one.
- ``gated_delta_rule``, ``mamba2_ssd``, ``mamba1_scan``: sequential in time.  One program
  per (sequence, head, tile of state columns or rows) keeps its slice of the state in
  registers for all the sequence's tokens and runs the decode step's per-token helper
  once per token (the tiles are independent: a delta-rule column depends only on the
  token's k, q, g and beta; a Mamba state row only on its own channel).  This is the form of
  fla's ``fused_recurrent`` kernels, not the chunked matrix form of the reference, so
  ``chunk_size`` is accepted for the signature and changes nothing (the result differs
  from the reference's by float32 rounding only).

Inputs are made contiguous by the launchers; states must be contiguous float32 (they are
written in place, so a copy would lose the update) or the launcher raises ``ValueError``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    interpreter_enabled,
    next_power_of_2,
)
from pagedserve.kernels.triton.recurrent import _gdn_token, _scan_token, _ssd_token

__all__ = [
    "causal_conv1d_triton",
    "gated_delta_rule_triton",
    "mamba2_ssd_triton",
    "mamba1_scan_triton",
    "PREFILL_KERNELS",
]

_ACTIVATIONS = (None, "silu", "swish")


def _check_varlen(query_start_loc: torch.Tensor, state: torch.Tensor, state_dims: int, name: str = "state") -> int:
    """The number of sequences, after checking ``query_start_loc`` and the state's rank and dtype."""
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32, torch.int64))
    if query_start_loc.numel() < 1:
        raise ValueError("query_start_loc must hold num_seqs + 1 >= 1 offsets")
    check_tensor(name, state, ndim=state_dims, dtypes=(torch.float32,), contiguous=True)
    return query_start_loc.numel() - 1


@triton.jit
def _find_seq(qsl_ptr, block, NUM_SEQS, BLOCK_T: tl.constexpr):
    """The sequence whose token tiles hold tile ``block`` (tiles of sequence i start at
    ``qsl[i] // BLOCK_T + i``: strictly increasing, one slot even for an empty sequence)."""
    lo = block * 0
    hi = lo + NUM_SEQS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_T + mid
        lo = tl.where(start <= block, mid, lo)
        hi = tl.where(start <= block, hi, mid)
    return lo


@triton.jit(do_not_specialize=["NUM_SEQS"])
def _conv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    qsl_ptr,
    has_ptr,
    out_ptr,
    NUM_SEQS,
    DIM: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    block = tl.program_id(0)
    s = _find_seq(qsl_ptr, block, NUM_SEQS, BLOCK_T)
    bos = tl.load(qsl_ptr + s)
    length = tl.load(qsl_ptr + s + 1) - bos
    t0 = (block - (bos // BLOCK_T + s)) * BLOCK_T
    if t0 >= length:
        return
    oc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < DIM
    ot = t0 + tl.arange(0, BLOCK_T)  # token index inside the sequence
    mt = ot < length
    # The earliest sequence index read from the window: -(W - 1), or 0 without a state.
    first = -(W - 1) * (tl.load(has_ptr + s) != 0).to(tl.int32)
    window = state_ptr + (s * DIM + oc).to(tl.int64) * (W - 1)  # [BLOCK_C] row starts
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        # Input at sequence index src: a new token, or (src < 0) the cached window's
        # entry W - 1 + src.
        src = ot - (W - 1) + j
        rows = (bos + src).to(tl.int64) * DIM
        xv = tl.load(x_ptr + rows[:, None] + oc[None, :], mask=(mt & (src >= 0))[:, None] & mc[None, :], other=0.0)
        sv = tl.load(
            window[None, :] + (src + (W - 1))[:, None],
            mask=(mt & (src < 0) & (src >= first))[:, None] & mc[None, :],
            other=0.0,
        )
        wj = tl.load(w_ptr + oc * W + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + oc, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    rows = (bos + ot).to(tl.int64) * DIM
    tl.store(out_ptr + rows[:, None] + oc[None, :], acc.to(out_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_window_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    has_ptr,
    DIM: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    s = tl.program_id(0)
    oc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < DIM
    bos = tl.load(qsl_ptr + s)
    length = tl.load(qsl_ptr + s + 1) - bos
    # The earliest sequence index read from the window: -(W - 1), or 0 without a state.
    first = -(W - 1) * (tl.load(has_ptr + s) != 0).to(tl.int32)
    op = tl.arange(0, WP)
    # Window entry p is the input at sequence index length - (W - 1) + p: a new token,
    # or (before the start) the old window's entry length + p.
    src = length - (W - 1) + op
    live = op < W - 1
    rows = (bos + src).to(tl.int64) * DIM
    xv = tl.load(x_ptr + rows[None, :] + oc[:, None], mask=mc[:, None] & (live & (src >= 0))[None, :], other=0.0)
    window = state_ptr + (s * DIM + oc).to(tl.int64)[:, None] * (W - 1)
    sv = tl.load(
        window + (length + op)[None, :], mask=mc[:, None] & (live & (src < 0) & (src >= first))[None, :], other=0.0
    )
    tl.debug_barrier()  # every old entry read before any is overwritten
    tl.store(window + op[None, :], xv.to(tl.float32) + sv, mask=mc[:, None] & live[None, :])


def causal_conv1d_triton(
    x, weight, bias, conv_state, query_start_loc, has_state, activation: str | None = "silu"
) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.causal_conv1d`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    num_seqs = _check_varlen(query_start_loc, conv_state, 3, "conv_state")
    check_same_device(x=x, weight=weight, conv_state=conv_state, query_start_loc=query_start_loc, has_state=has_state)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported (supported: silu, None)")
    tokens, dim = x.shape
    width = weight.shape[1]
    if weight.shape[0] != dim or width < 2:
        raise ValueError(f"weight must be [{dim}, width >= 2], got {tuple(weight.shape)}")
    if tuple(conv_state.shape) != (num_seqs, dim, width - 1):
        raise ValueError(f"conv_state must be [{num_seqs}, {dim}, {width - 1}], got {tuple(conv_state.shape)}")
    if has_state.numel() != num_seqs:
        raise ValueError(f"has_state must hold one flag per sequence ({num_seqs}), got {has_state.numel()}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [{dim}], got {tuple(bias.shape)}")
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    qsl = query_start_loc.to(torch.int32).contiguous()
    has = has_state.to(torch.int32).contiguous()
    x, weight = x.contiguous(), weight.contiguous()
    b = bias.contiguous() if bias is not None else weight
    block_t, block_c = 16, min(128, next_power_of_2(dim))
    channel_blocks = triton.cdiv(dim, block_c)
    if tokens:
        grid = (tokens // block_t + num_seqs, channel_blocks)
        flags = dict(HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=block_c)
        _conv_kernel[grid](x, weight, b, conv_state, qsl, has, out, num_seqs, DIM=dim, W=width, **flags)
    _conv_window_kernel[(num_seqs, channel_blocks)](
        x, conv_state, qsl, has, dim, width, next_power_of_2(width - 1), block_c
    )
    return out


@triton.jit
def _gdn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    qsl_ptr,
    out_ptr,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    ok = tl.arange(0, BK)
    ov = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    # int64 token indices: the loop variable is one (under the interpreter a Python int).
    bos = tl.load(qsl_ptr + s).to(tl.int64)
    eos = tl.load(qsl_ptr + s + 1).to(tl.int64)
    base = state_ptr + (s * HV + h).to(tl.int64) * DK * DV
    offs = ok[:, None] * DV + ov[None, :]
    m2 = mk[:, None] & mv[None, :]
    st = tl.load(base + offs, mask=m2, other=0.0)
    for t in range(bos, eos):
        st = _gdn_token(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, st, t, h, kh, ok, ov, mk, mv, scale, HK, HV, DK, DV, L2NORM
        )
    tl.store(base + offs, st, mask=m2)


def gated_delta_rule_triton(
    q, k, v, g, beta, state, query_start_loc, use_qk_l2norm: bool = True, chunk_size: int = 64
) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.gated_delta_rule` (``chunk_size``
    changes nothing: the kernel runs the recursion token by token)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES)
    num_seqs = _check_varlen(query_start_loc, state, 4)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, query_start_loc=query_start_loc)
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != n or hv % hk:
        raise ValueError(f"q, k must be [{n}, key heads, dk] and v [{n}, value heads (a multiple of key heads), dv]")
    if tuple(g.shape) != (n, hv) or tuple(beta.shape) != (n, hv):
        raise ValueError(f"g and beta must be [{n}, {hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if tuple(state.shape) != (num_seqs, hv, dk, dv):
        raise ValueError(f"state must be [{num_seqs}, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    out = torch.empty_like(v)
    if num_seqs == 0:
        return out
    qsl = query_start_loc.to(torch.int32).contiguous()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    bk = next_power_of_2(dk)
    # fla's fused_recurrent configuration: one warp per [dk, 8] slice of the state, so
    # that the per-token reductions over dk stay inside a warp.  The interpreter's cost
    # is per program and operation, not per element: there, slices of 32 columns.
    bv = min(next_power_of_2(dv), 32 if interpreter_enabled() else 8)
    grid = (num_seqs, hv, triton.cdiv(dv, bv))
    _gdn_kernel[grid](
        q, k, v, g, beta, state, qsl, out, dk**-0.5, hk, hv, dk, dv, bk, bv, bool(use_qk_l2norm), num_warps=1
    )
    return out


@triton.jit
def _ssd_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    state_ptr,
    qsl_ptr,
    out_ptr,
    H: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // (H // G)
    op = tl.program_id(2) * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    # int64 token indices: the loop variable is one (under the interpreter a Python int).
    bos = tl.load(qsl_ptr + s).to(tl.int64)
    eos = tl.load(qsl_ptr + s + 1).to(tl.int64)
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    base = state_ptr + (s * H + h).to(tl.int64) * P * N
    offs = op[:, None] * N + on[None, :]
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(base + offs, mask=m2, other=0.0)
    for t in range(bos, eos):
        st = _ssd_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, t, h, grp, op, on, mp, mn, a, d, H, G, P, N)
    tl.store(base + offs, st, mask=m2)


def mamba2_ssd_triton(x, dt, A, B, C, D, state, query_start_loc, chunk_size: int = 256) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.mamba2_ssd` (``chunk_size``
    changes nothing: the kernel runs the recursion token by token)."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("B", B, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("C", C, ndim=3, dtypes=FLOAT_DTYPES)
    num_seqs = _check_varlen(query_start_loc, state, 4)
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, state=state, query_start_loc=query_start_loc)
    n, heads, p = x.shape
    groups, d_state = B.shape[1:]
    if B.shape[0] != n or C.shape != B.shape or heads % groups:
        raise ValueError(f"B and C must be [{n}, groups, d_state] with the {heads} heads a multiple of groups")
    if tuple(dt.shape) != (n, heads) or A.numel() != heads or D.numel() != heads:
        raise ValueError(f"dt must be [{n}, {heads}] and A, D [{heads}]")
    if tuple(state.shape) != (num_seqs, heads, p, d_state):
        raise ValueError(f"state must be [{num_seqs}, {heads}, {p}, {d_state}], got {tuple(state.shape)}")
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    qsl = query_start_loc.to(torch.int32).contiguous()
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    bn = next_power_of_2(d_state)
    # Rows of head_dim per program by d_state, as mamba_ssm's selective_state_update.
    bp = min(next_power_of_2(p), {16: 32, 32: 16, 64: 8}.get(bn, 32 if bn < 16 else 4))
    grid = (num_seqs, heads, triton.cdiv(p, bp))
    warps = 8 if bn > 128 else 4
    _ssd_kernel[grid](x, dt, A, B, C, D, state, qsl, out, heads, groups, p, d_state, bp, bn, num_warps=warps)
    return out


@triton.jit
def _scan_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    state_ptr,
    qsl_ptr,
    out_ptr,
    DIM: tl.constexpr,
    N: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
):
    s = tl.program_id(0)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md = od < DIM
    mn = on < N
    m2 = md[:, None] & mn[None, :]
    # int64 token indices: the loop variable is one (under the interpreter a Python int).
    bos = tl.load(qsl_ptr + s).to(tl.int64)
    eos = tl.load(qsl_ptr + s + 1).to(tl.int64)
    a = tl.load(a_ptr + od[:, None] * N + on[None, :], mask=m2, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + od, mask=md, other=0.0).to(tl.float32)
    offs = (s * DIM + od[:, None]).to(tl.int64) * N + on[None, :]
    st = tl.load(state_ptr + offs, mask=m2, other=0.0)
    for t in range(bos, eos):
        st = _scan_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, t, od, on, md, mn, a, d, DIM, N)
    tl.store(state_ptr + offs, st, mask=m2)


def mamba1_scan_triton(x, dt, A, B, C, D, state, query_start_loc, chunk_size: int = 16) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.mamba1_scan` (``chunk_size``
    changes nothing: the kernel runs the recursion token by token)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("B", B, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("C", C, ndim=2, dtypes=FLOAT_DTYPES)
    num_seqs = _check_varlen(query_start_loc, state, 3)
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, state=state, query_start_loc=query_start_loc)
    n, dim = x.shape
    d_state = B.shape[1]
    if B.shape[0] != n or C.shape != B.shape or tuple(dt.shape) != (n, dim):
        raise ValueError(f"dt must be [{n}, {dim}] and B, C [{n}, d_state]")
    if tuple(A.shape) != (dim, d_state) or D.numel() != dim:
        raise ValueError(f"A must be [{dim}, {d_state}] and D [{dim}]")
    if tuple(state.shape) != (num_seqs, dim, d_state):
        raise ValueError(f"state must be [{num_seqs}, {dim}, {d_state}], got {tuple(state.shape)}")
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    qsl = query_start_loc.to(torch.int32).contiguous()
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    bn = next_power_of_2(d_state)
    bd = max(1, min(next_power_of_2(dim), 32, 2048 // bn))
    grid = (num_seqs, triton.cdiv(dim, bd))
    _scan_kernel[grid](x, dt, A, B, C, D, state, qsl, out, dim, d_state, bd, bn, num_warps=1 if bn <= 32 else 4)
    return out


#: The op-registry entries of this module, by op name.
PREFILL_KERNELS = {
    "causal_conv1d": causal_conv1d_triton,
    "gated_delta_rule": gated_delta_rule_triton,
    "mamba2_ssd": mamba2_ssd_triton,
    "mamba1_scan": mamba1_scan_triton,
}
