"""Decode-step kernels of the recurrent layers in Triton: one token per sequence.

- ``gated_delta_rule_recurrent``: one program per (sequence, value head) holds the head's
  ``[dk, dv]`` state in registers, decays it, writes the delta-rule update and reads the
  output (q and k L2-normalised in the kernel when asked).
- ``mamba2_ssd_step``: one program per (sequence, head), ``[head_dim, d_state]`` state.
- ``mamba1_scan_step``: one program per (sequence, block of channels), each channel's
  ``[d_state]`` state row with its own decays ``exp(dt * A[channel])``.
- ``causal_conv1d_update``: one program per (sequence, block of channels) shifts the
  window and applies the depthwise filter, bias and SiLU.

States are float32 and updated in place, as :mod:`pagedserve.kernels.recurrent_reference`
specifies; inputs are made contiguous by the launchers.  Each step's per-token work
(``_gdn_token``, ``_ssd_token``, ``_scan_token``) is written once, here: the prefill kernels
of :mod:`pagedserve.kernels.triton.recurrent_prefill` run it for every token of a sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2

__all__ = [
    "gated_delta_rule_recurrent_triton",
    "mamba2_ssd_step_triton",
    "mamba1_scan_step_triton",
    "causal_conv1d_update_triton",
]


@triton.jit
def _gdn_token(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, st, t, h, kh, ok, ov, mk, mv, scale, HK, HV, DK, DV, L2NORM
):
    """One token ``t`` of the delta-rule recursion on a ``[BK, BV]`` slice ``st`` of
    value head ``h``'s state (columns ``ov``): writes the token's output, returns the new
    slice.  Shared by the decode step and the prefill kernel; the shapes and L2NORM come
    in as the caller's constexprs (the jit specialises on them)."""
    q = tl.load(q_ptr + (t * HK + kh) * DK + ok, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (t * HK + kh) * DK + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (t * HV + h) * DV + ov, mask=mv, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    g = tl.load(g_ptr + t * HV + h).to(tl.float32)
    beta = tl.load(beta_ptr + t * HV + h).to(tl.float32)
    st = st * tl.exp(g)
    delta = (v - tl.sum(st * k[:, None], axis=0)) * beta
    st = st + k[:, None] * delta[None, :]
    o = tl.sum(st * q[:, None], axis=0)
    tl.store(out_ptr + (t * HV + h) * DV + ov, o.to(out_ptr.dtype.element_ty), mask=mv)
    return st


@triton.jit
def _gdn_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
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
    ov = tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    base = state_ptr + (s * HV + h) * DK * DV
    offs = ok[:, None] * DV + ov[None, :]
    m2 = mk[:, None] & mv[None, :]
    st = tl.load(base + offs, mask=m2, other=0.0)
    st = _gdn_token(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, st, s, h, kh, ok, ov, mk, mv, scale, HK, HV, DK, DV, L2NORM
    )
    tl.store(base + offs, st, mask=m2)


def gated_delta_rule_recurrent_triton(q, k, v, g, beta, state, use_qk_l2norm: bool = True) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.gated_delta_rule_recurrent`."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,), contiguous=True)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state)
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk or tuple(state.shape) != (n, hv, dk, dv):
        raise ValueError(f"state must be [{n}, {hv}, {dk}, {dv}] with value heads a multiple of key heads")
    out = torch.empty_like(v)
    if n == 0:
        return out
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    bk, bv = next_power_of_2(dk), next_power_of_2(dv)
    _gdn_step_kernel[(n, hv)](q, k, v, g, beta, state, out, dk**-0.5, hk, hv, dk, dv, bk, bv, bool(use_qk_l2norm))
    return out


@triton.jit
def _ssm_token(st, decay, x, dt, b, c, d):
    """One token of the Mamba recursion on state rows ``st`` (one per x entry, d_state
    columns): ``st * decay + (dt * x) b^T``; returns the new rows and ``y = st c + d x``."""
    st = st * decay + (dt * x)[:, None] * b[None, :]
    y = tl.sum(st * c[None, :], axis=1) + d * x
    return st, y


@triton.jit
def _ssd_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, t, h, grp, op, on, mp, mn, a, d, H, G, P, N):
    """One token ``t`` of Mamba 2's recursion on head ``h``'s state rows ``op``: writes
    the token's output, returns the new rows.  Shared by the decode step and the prefill
    kernel."""
    x = tl.load(x_ptr + (t * H + h) * P + op, mask=mp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + t * H + h).to(tl.float32)
    b = tl.load(b_ptr + (t * G + grp) * N + on, mask=mn, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + (t * G + grp) * N + on, mask=mn, other=0.0).to(tl.float32)
    st, y = _ssm_token(st, tl.exp(dt * a), x, dt, b, c, d)
    tl.store(out_ptr + (t * H + h) * P + op, y.to(out_ptr.dtype.element_ty), mask=mp)
    return st


@triton.jit
def _ssd_step_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    state_ptr,
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
    op = tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    base = state_ptr + (s * H + h) * P * N
    offs = op[:, None] * N + on[None, :]
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(base + offs, mask=m2, other=0.0)
    st = _ssd_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, s, h, grp, op, on, mp, mn, a, d, H, G, P, N)
    tl.store(base + offs, st, mask=m2)


def mamba2_ssd_step_triton(x, dt, A, B, C, D, state) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.mamba2_ssd_step`."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("B", B, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,), contiguous=True)
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, state=state)
    n, heads, p = x.shape
    groups, d_state = B.shape[1:]
    if heads % groups or tuple(state.shape) != (n, heads, p, d_state):
        raise ValueError(f"state must be [{n}, {heads}, {p}, {d_state}] with heads a multiple of groups")
    out = torch.empty_like(x)
    if n == 0:
        return out
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    _ssd_step_kernel[(n, heads)](
        x, dt, A, B, C, D, state, out, heads, groups, p, d_state, next_power_of_2(p), next_power_of_2(d_state)
    )
    return out


@triton.jit
def _scan_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, t, od, on, md, mn, a, d, DIM, N):
    """One token ``t`` of Mamba 1's recursion on the state rows of channels ``od``
    (decays ``exp(dt * A)`` per channel and entry): writes the token's output, returns
    the new rows.  Shared by the decode step and the prefill kernel."""
    x = tl.load(x_ptr + t * DIM + od, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + t * DIM + od, mask=md, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * N + on, mask=mn, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t * N + on, mask=mn, other=0.0).to(tl.float32)
    st, y = _ssm_token(st, tl.exp(dt[:, None] * a), x, dt, b, c, d)
    tl.store(out_ptr + t * DIM + od, y.to(out_ptr.dtype.element_ty), mask=md)
    return st


@triton.jit
def _scan_step_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    state_ptr,
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
    d = tl.load(d_ptr + od, mask=md, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + od[:, None] * N + on[None, :], mask=m2, other=0.0).to(tl.float32)
    offs = (s * DIM + od[:, None]) * N + on[None, :]
    st = tl.load(state_ptr + offs, mask=m2, other=0.0)
    st = _scan_token(x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr, st, s, od, on, md, mn, a, d, DIM, N)
    tl.store(state_ptr + offs, st, mask=m2)


def mamba1_scan_step_triton(x, dt, A, B, C, D, state) -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.mamba1_scan_step`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("B", B, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("state", state, ndim=3, dtypes=(torch.float32,), contiguous=True)
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, state=state)
    n, dim = x.shape
    d_state = B.shape[1]
    if tuple(state.shape) != (n, dim, d_state) or tuple(A.shape) != (dim, d_state):
        raise ValueError(f"state must be [{n}, {dim}, {d_state}] and A [{dim}, {d_state}]")
    out = torch.empty_like(x)
    if n == 0:
        return out
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    bn = next_power_of_2(d_state)
    bd = max(1, min(next_power_of_2(dim), 4096 // bn))
    _scan_step_kernel[(n, triton.cdiv(dim, bd))](x, dt, A, B, C, D, state, out, dim, d_state, bd, bn)
    return out


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    DIM: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    oc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mc = oc < DIM
    x = tl.load(x_ptr + s * DIM + oc, mask=mc, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + oc * W + (W - 1), mask=mc, other=0.0).to(tl.float32)
    base = state_ptr + (s * DIM + oc) * (W - 1)
    # The window's oldest value leaves; each later one moves one place towards the start.
    for j in tl.static_range(W - 1):
        prev = tl.load(base + j, mask=mc, other=0.0)
        acc += prev * tl.load(w_ptr + oc * W + j, mask=mc, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1), prev, mask=mc)
    tl.store(base + (W - 2), x, mask=mc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + oc, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + s * DIM + oc, acc.to(out_ptr.dtype.element_ty), mask=mc)


def causal_conv1d_update_triton(x, weight, bias, conv_state, activation: str | None = "silu") -> torch.Tensor:
    """See :func:`pagedserve.kernels.recurrent_reference.causal_conv1d_update`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("conv_state", conv_state, ndim=3, dtypes=(torch.float32,), contiguous=True)
    check_same_device(x=x, weight=weight, conv_state=conv_state)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation {activation!r} is not supported (supported: silu, None)")
    n, dim = x.shape
    width = weight.shape[1]
    if width < 2 or tuple(conv_state.shape) != (n, dim, width - 1):
        raise ValueError(f"conv_state must be [{n}, {dim}, {width - 1}] for a filter of width {width} >= 2")
    out = torch.empty_like(x)
    if n == 0:
        return out
    block = min(256, next_power_of_2(dim))
    x, weight = x.contiguous(), weight.contiguous()
    b = bias.contiguous() if bias is not None else weight
    _conv_update_kernel[(n, triton.cdiv(dim, block))](
        x, weight, b, conv_state, out, dim, width, bias is not None, activation is not None, block
    )
    return out
