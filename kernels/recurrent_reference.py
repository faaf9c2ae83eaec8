"""Pure-torch reference of the recurrent-layer ops (re-exported by :mod:`reference`).

Layers with a fixed-size state instead of attention over every key: the short causal
convolution in front of them (with its cache of the last ``width - 1`` inputs), Gated
DeltaNet (Qwen3.5, Qwen3-Next), Mamba 2's state-space scan (Granite 4), Mamba 1's
selective scan (a ``[dim, d_state]`` state with a decay per channel and state entry:
Jamba) and their gated RMSNorms.  Each op works on a varlen batch:
the tokens of all sequences flattened (``[num_tokens, ...]``) with ``query_start_loc``
(int32 ``[num_seqs + 1]``) marking each sequence's slice, and one state per sequence.
States are float32 and updated in place; the caller starts a sequence's first chunk from
a zero state (or passes ``has_state`` where the op takes it).

Gated DeltaNet, per value head, with key ``k_t``, query ``q_t`` (both L2-normalised when
asked, the query then scaled by ``dk ** -0.5``), value ``v_t``, decay ``g_t <= 0`` (log
space) and write strength ``beta_t``; the state ``S`` is ``[dk, dv]``::

    S   <- exp(g_t) * S
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t  = S^T q_t

:func:`gated_delta_rule_recurrent` is that recursion for one token per sequence (decode);
:func:`gated_delta_rule` computes the same in chunks of ``chunk_size`` tokens (prefill):
inside a chunk the delta-rule writes form a unit lower-triangular system, solved once per
chunk, and only the chunk's last state is carried to the next one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The recurrent-layer ops, by the names they are registered under.
RECURRENT_OP_NAMES: tuple[str, ...] = (
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_delta_rule",
    "gated_delta_rule_recurrent",
    "rms_norm_gated",
    "mamba2_ssd",
    "mamba2_ssd_step",
    "mamba1_scan",
    "mamba1_scan_step",
)

__all__ = [*RECURRENT_OP_NAMES, "RECURRENT_OP_NAMES"]


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"activation {activation!r} is not supported (supported: silu, None)")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution of each sequence's tokens, continuing its cache.

    x: [num_tokens, dim]; weight: [dim, width]; bias: [dim] or None.
    conv_state: float32 [num_seqs, dim, width - 1], the inputs just before each
        sequence's tokens (oldest first); read where ``has_state`` (bool [num_seqs]),
        zeros elsewhere; on return the last ``width - 1`` inputs including the new ones.
    Returns activation(conv) [num_tokens, dim] in x's dtype.
    """
    dim, width = weight.shape
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        prev = conv_state[i] if bool(has_state[i]) else conv_state.new_zeros(dim, width - 1)
        xx = torch.cat([prev, x[s:e].float().t()], dim=1)  # [dim, width - 1 + len]
        y = F.conv1d(xx.unsqueeze(0), w, b, groups=dim)[0]  # [dim, len]
        out[s:e] = _activate(y, activation).t().to(x.dtype)
        conv_state[i] = xx[:, xx.shape[1] - (width - 1) :]
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token per sequence (decode): x [num_seqs, dim] -> [num_seqs, dim];
    conv_state float32 [num_seqs, dim, width - 1] is read and shifted in place."""
    xx = torch.cat([conv_state, x.float().unsqueeze(-1)], dim=-1)  # [seqs, dim, width]
    y = (xx * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state.copy_(xx[..., 1:])
    return _activate(y, activation).to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k with their heads repeated to the value heads, normalised and scaled."""
    rep = num_v_heads // q.shape[1]
    q, k = q.float().repeat_interleave(rep, dim=1), k.float().repeat_interleave(rep, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token per sequence (decode).

    q, k: [num_seqs, num_k_heads, dk]; v: [num_seqs, num_v_heads, dv] (num_v_heads a
    multiple of num_k_heads); g, beta: [num_seqs, num_v_heads]; state: float32
    [num_seqs, num_v_heads, dk, dv], updated in place.  Returns [num_seqs, num_v_heads, dv]
    in v's dtype.
    """
    qf, kf = _prepare_qk(q, k, v.shape[1], use_qk_l2norm)
    s = state * g.float().exp()[..., None, None]
    mem = torch.einsum("nhkv,nhk->nhv", s, kf)
    delta = (v.float() - mem) * beta.float()[..., None]
    s = s + kf.unsqueeze(-1) * delta.unsqueeze(-2)
    state.copy_(s)
    return torch.einsum("nhkv,nhk->nhv", s, qf).to(v.dtype)


def _causal_decay(cum: torch.Tensor, dim: int) -> torch.Tensor:
    """``exp(cum_i - cum_j)`` for tokens ``j <= i`` and 0 above the diagonal, from the
    cumulative log decays ``cum`` along token dimension ``dim``: the pair ``(i, j)`` at
    dimensions ``dim, dim + 1`` of the result."""
    diff = cum.unsqueeze(dim + 1) - cum.unsqueeze(dim)
    n = cum.shape[dim]
    causal = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril().view(n, n, *[1] * (cum.dim() - dim - 1))
    return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()


def _delta_rule_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    s: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float32: q, k [H, L, dk], v [H, L, dv], g, beta [H, L], s [H, dk, dv]
    -> (o [H, L, dv], final state)."""
    H, L, _ = k.shape
    out = torch.empty(H, L, v.shape[-1], dtype=torch.float32, device=v.device)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = g[:, c0:c1].cumsum(-1)  # [H, C] log decay from the chunk start through each token
        decay = _causal_decay(G, 1)  # [H, C, C]
        # Token i's write is beta_i (v_i - S_{i-1}^T k_i); S_{i-1} holds the decayed chunk
        # start state and the earlier writes u_j: (I + A) u = beta (v - exp(G) k S0).
        kk = (kc @ kc.transpose(-1, -2)) * decay
        A = (bc.unsqueeze(-1) * kk).tril(-1)
        eye = torch.eye(c1 - c0, dtype=torch.float32, device=v.device)
        rhs = bc.unsqueeze(-1) * (vc - (kc * G.exp().unsqueeze(-1)) @ s)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        # o_i = exp(G_i) S0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j
        qk = (qc @ kc.transpose(-1, -2)) * decay
        out[:, c0:c1] = (qc * G.exp().unsqueeze(-1)) @ s + qk @ u
        last = G[:, -1:]
        s = s * last.exp().unsqueeze(-1) + (kc * (last - G).exp().unsqueeze(-1)).transpose(-1, -2) @ u
    return out, s


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Chunked Gated DeltaNet over a varlen batch (prefill, or any mix).

    q, k: [num_tokens, num_k_heads, dk]; v: [num_tokens, num_v_heads, dv]; g, beta:
    [num_tokens, num_v_heads]; state: float32 [num_seqs, num_v_heads, dk, dv], each
    sequence's state before its tokens (zeros to start one), updated in place;
    query_start_loc: int32 [num_seqs + 1].  Returns [num_tokens, num_v_heads, dv] in v's dtype.
    """
    qf, kf = _prepare_qk(q, k, v.shape[1], use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        o, final = _delta_rule_chunks(
            qf[s:e].transpose(0, 1),
            kf[s:e].transpose(0, 1),
            vf[s:e].transpose(0, 1),
            gf[s:e].t(),
            bf[s:e].t(),
            state[i],
            chunk_size,
        )
        out[s:e] = o.transpose(0, 1).to(v.dtype)
        state[i] = final
    return out


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_before_gate: bool = True,
    group_size: int | None = None,
) -> torch.Tensor:
    """Gated RMSNorm of x [n, d] with gate [n, d] and ``weight`` [d]; float32 inside,
    x's dtype out.  ``norm_before_gate``: rms_norm(x) * weight * silu(gate) (Gated
    DeltaNet's output norm); else rms_norm(x * silu(gate)) * weight (Mamba 2's).  The
    mean of squares runs over groups of ``group_size`` channels (None: all ``d``)."""
    n, d = x.shape
    size = d if group_size is None else group_size
    xf, gf = x.float(), F.silu(gate.float())
    if not norm_before_gate:
        xf = xf * gf
    grouped = xf.view(n, d // size, size)
    h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(n, d) * weight.float()
    if norm_before_gate:
        h = h * gf
    return h.to(x.dtype)


def _ssd_inputs(x, dt, B, C):
    """float32 x [.., H, P], dt [.., H], and B, C [.., G, N] repeated to the H heads."""
    rep = x.shape[-2] // B.shape[-2]
    return x.float(), dt.float(), B.float().repeat_interleave(rep, dim=-2), C.float().repeat_interleave(rep, dim=-2)


def mamba2_ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Mamba 2's selective state update for one token per sequence (decode).

    x: [num_seqs, heads, head_dim]; dt: [num_seqs, heads], the step sizes (after
    softplus and any clamp); A, D: float32 [heads] (A < 0); B, C: [num_seqs, groups,
    d_state] (heads split evenly over groups); state: float32 [num_seqs, heads, head_dim,
    d_state], updated in place::

        state <- exp(dt * A) * state + dt * x B^T;   y = state C + D * x

    Returns y [num_seqs, heads, head_dim] in x's dtype.
    """
    xf, dtf, Bf, Cf = _ssd_inputs(x, dt, B, C)
    decay = (dtf * A.float()).exp()[..., None, None]
    s = state * decay + (dtf[..., None] * xf).unsqueeze(-1) * Bf.unsqueeze(-2)
    state.copy_(s)
    y = torch.einsum("shpn,shn->shp", s, Cf) + D.float()[:, None] * xf
    return y.to(x.dtype)


def _ssd_chunks(x, dt, A, B, C, s, chunk):
    """One sequence, float32: x [H, L, P], dt [H, L], A [H], B, C [H, L, N], s [H, P, N]
    -> (y without the D term [H, L, P], final state)."""
    H, L, P = x.shape
    out = torch.empty_like(x)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        xc, dtc, Bc, Cc = x[:, c0:c1], dt[:, c0:c1], B[:, c0:c1], C[:, c0:c1]
        cum = (dtc * A[:, None]).cumsum(-1)  # [H, C] log decay from the chunk start through each token
        decay = _causal_decay(cum, 1)  # [H, C, C]
        # y_i = exp(cum_i) C_i . S0 + sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j
        scores = (Cc @ Bc.transpose(-1, -2)) * decay
        u = xc * dtc.unsqueeze(-1)
        out[:, c0:c1] = scores @ u + (Cc @ s.transpose(-1, -2)) * cum.exp().unsqueeze(-1)
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (u * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ Bc
    return out, s


def mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Mamba 2's state-space scan in chunks (SSD) over a varlen batch: the recursion of
    :func:`mamba2_ssd_step` for every token.  x: [num_tokens, heads, head_dim]; dt:
    [num_tokens, heads]; B, C: [num_tokens, groups, d_state]; state: float32 [num_seqs,
    heads, head_dim, d_state], each sequence's state before its tokens (zeros to start
    one), updated in place.  Returns y [num_tokens, heads, head_dim] in x's dtype."""
    xf, dtf, Bf, Cf = _ssd_inputs(x, dt, B, C)
    Af, Df = A.float(), D.float()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        y, final = _ssd_chunks(
            xf[s:e].transpose(0, 1),
            dtf[s:e].t(),
            Af,
            Bf[s:e].transpose(0, 1),
            Cf[s:e].transpose(0, 1),
            state[i],
            chunk_size,
        )
        out[s:e] = (y.transpose(0, 1) + Df[:, None] * xf[s:e]).to(x.dtype)
        state[i] = final
    return out


def mamba1_scan_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state
) -> torch.Tensor:
    """Mamba 1's selective state update for one token per sequence (decode).

    x, dt: [num_seqs, dim] (dt the step sizes, after softplus); A: float32 [dim, d_state]
    (A < 0); B, C: [num_seqs, d_state]; D: float32 [dim]; state: float32 [num_seqs, dim,
    d_state], updated in place::

        state <- exp(dt A) * state + dt x B^T;   y = state C + D * x

    Returns y [num_seqs, dim] in x's dtype.
    """
    xf, dtf = x.float(), dt.float()
    s = state * (dtf.unsqueeze(-1) * A.float()).exp() + (dtf * xf).unsqueeze(-1) * B.float().unsqueeze(-2)
    state.copy_(s)
    y = torch.einsum("sdn,sn->sd", s, C.float()) + D.float() * xf
    return y.to(x.dtype)


def _scan_chunks(x, dt, A, B, C, s, chunk):
    """One sequence, float32: x, dt [L, D], A [D, N], B, C [L, N], s [D, N] -> (y without
    the D term [L, D], final state).  In a chunk, with ``cum_t = sum_{j <= t} dt_j A``::

        h_t = exp(cum_t) s + sum_{j <= t} exp(cum_t - cum_j) dt_j x_j B_j
    """
    L = x.shape[0]
    out = torch.empty_like(x)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        cum = (dt[c0:c1].unsqueeze(-1) * A).cumsum(0)  # [n, D, N]
        u = (dt[c0:c1] * x[c0:c1]).unsqueeze(-1) * B[c0:c1].unsqueeze(1)  # [n, D, N]
        decay = _causal_decay(cum, 0)  # [t, j, D, N]
        h = (decay * u.unsqueeze(0)).sum(1) + cum.exp() * s  # [n, D, N]
        out[c0:c1] = torch.einsum("tdn,tn->td", h, C[c0:c1])
        s = h[-1]
    return out, s


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    chunk_size: int = 16,
) -> torch.Tensor:
    """Mamba 1's selective scan over a varlen batch, in chunks: the recursion of
    :func:`mamba1_scan_step` for every token.  x, dt: [num_tokens, dim]; B, C:
    [num_tokens, d_state]; A float32 [dim, d_state]; D float32 [dim]; state: float32
    [num_seqs, dim, d_state], each sequence's state before its tokens (zeros to start one),
    updated in place.  Returns y [num_tokens, dim] in x's dtype."""
    xf, dtf, Bf, Cf, Af = x.float(), dt.float(), B.float(), C.float(), A.float()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        y, final = _scan_chunks(xf[s:e], dtf[s:e], Af, Bf[s:e], Cf[s:e], state[i], chunk_size)
        out[s:e] = (y + D.float() * xf[s:e]).to(x.dtype)
        state[i] = final
    return out
