"""The recurrent-layer reference ops (kernels/recurrent_reference.py) against independent
formulations: the chunked Gated DeltaNet against its token-by-token recursion (and both
against transformers' own torch versions), the varlen causal convolution against a
plain padded ``conv1d`` and against its one-token update, on fresh random inputs with
states carried across chunks and sequences of different lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import reference as ref

transformers = pytest.importorskip("transformers")


def _hf():
    """transformers' Qwen3.5 modeling module, imported when a test runs: importing it can
    import triton, which must not happen at collection, before the Triton tests set
    TRITON_INTERPRET."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _gdn_inputs(gen: torch.Generator, lens: list[int], hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 12):
    t = sum(lens)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(t, hv, generator=gen))  # log decays <= 0
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    state = torch.randn(len(lens), hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state, _qsl(lens)


def _step_by_step(step, out: torch.Tensor, state: torch.Tensor, qsl: torch.Tensor):
    """The recursion one token at a time through a decode op: ``step(sl, s)`` runs it on
    the tokens of slice ``sl`` with their sequence's state ``s`` ([1, ...], updated in
    place).  Fills ``out`` (NaN-poisoned by the caller); returns it and the final states."""
    state = state.clone()
    for i in range(len(qsl) - 1):
        s = state[i : i + 1].clone()
        for t in range(int(qsl[i]), int(qsl[i + 1])):
            sl = slice(t, t + 1)
            out[sl] = step(sl, s)
        state[i] = s[0]
    return out, state


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_gated_delta_rule_equals_its_recursion(chunk):
    gen = torch.Generator().manual_seed(chunk)
    q, k, v, g, beta, state, qsl = _gdn_inputs(gen, [1, 37, 9, 70])
    s_chunked = state.clone()
    out = ref.gated_delta_rule(q, k, v, g, beta, s_chunked, qsl, True, chunk)
    want, s_want = _step_by_step(
        lambda sl, s: ref.gated_delta_rule_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], s),
        torch.full_like(v, float("nan")),
        state,
        qsl,
    )
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chunked, s_want, rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_matches_transformers_and_carries_state_across_calls():
    hf = _hf()
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta, state, _ = _gdn_inputs(gen, [50])
    want, s_want = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    # The same sequence in two calls (a chunked prefill of 23 then 27 tokens).
    s = state.clone()
    a = ref.gated_delta_rule(q[:23], k[:23], v[:23], g[:23], beta[:23], s, torch.tensor([0, 23], dtype=torch.int32))
    b = ref.gated_delta_rule(q[23:], k[23:], v[23:], g[23:], beta[23:], s, torch.tensor([0, 27], dtype=torch.int32))
    torch.testing.assert_close(torch.cat([a, b]), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_want, rtol=1e-4, atol=1e-4)
    one, s_one = hf.torch_recurrent_gated_delta_rule(
        q[None, :1],
        k[None, :1],
        v[None, :1],
        g[None, :1],
        beta[None, :1],
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    s2 = state.clone()
    got = ref.gated_delta_rule_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], s2)
    torch.testing.assert_close(got, one[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_one, rtol=1e-5, atol=1e-5)


def test_causal_conv1d_varlen_continues_its_cache():
    gen = torch.Generator().manual_seed(2)
    dim, width, lens = 10, 4, [1, 2, 7, 13]
    x = torch.randn(sum(lens), dim, generator=gen)
    w = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen)
    prev = torch.randn(len(lens), dim, width - 1, generator=gen)
    has = torch.tensor([True, False, True, False])
    qsl = _qsl(lens)
    state = prev.clone()
    out = ref.causal_conv1d(x, w, bias, state, qsl, has, "silu")
    for i, (s, e) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        before = prev[i] if has[i] else torch.zeros(dim, width - 1)
        full = torch.cat([before, x[s:e].t()], dim=1)
        want = F.silu(F.conv1d(full[None], w[:, None], bias, groups=dim)[0]).t()
        torch.testing.assert_close(out[s:e], want)
        torch.testing.assert_close(state[i], full[:, -(width - 1) :])
    # Decode: one token per sequence through the update op equals the varlen op.
    y = torch.randn(len(lens), dim, generator=gen)
    s_upd, s_var = state.clone(), state.clone()
    got = ref.causal_conv1d_update(y, w, bias, s_upd, "silu")
    want = ref.causal_conv1d(y, w, bias, s_var, torch.arange(len(lens) + 1, dtype=torch.int32), has | True, "silu")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(s_upd, s_var)


def test_rms_norm_gated_matches_transformers():
    hf = _hf()
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(6, 12, generator=gen), torch.randn(6, 12, generator=gen)
    norm = hf.Qwen3_5RMSNormGated(12, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen))
        torch.testing.assert_close(ref.rms_norm_gated(x, z, norm.weight, 1e-5), norm(x, z))


def _ssd_inputs(gen: torch.Generator, lens: list[int], heads: int = 4, head_dim: int = 6, groups: int = 2, n: int = 5):
    t = sum(lens)
    x = torch.randn(t, heads, head_dim, generator=gen)
    dt = F.softplus(torch.randn(t, heads, generator=gen))
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    B = torch.randn(t, groups, n, generator=gen)
    C = torch.randn(t, groups, n, generator=gen)
    D = torch.randn(heads, generator=gen)
    state = torch.randn(len(lens), heads, head_dim, n, generator=gen) * 0.3
    return x, dt, A, B, C, D, state, _qsl(lens)


def test_mamba2_step_is_the_state_space_recursion():
    gen = torch.Generator().manual_seed(4)
    x, dt, A, B, C, D, state, _ = _ssd_inputs(gen, [1, 1, 1])
    s = state.clone()
    y = ref.mamba2_ssd_step(x, dt, A, B, C, D, s)
    for i in range(3):
        for h in range(4):
            g = h // 2  # 4 heads over 2 groups
            new = torch.exp(dt[i, h] * A[h]) * state[i, h] + dt[i, h] * torch.outer(x[i, h], B[i, g])
            torch.testing.assert_close(s[i, h], new)
            torch.testing.assert_close(y[i, h], new @ C[i, g] + D[h] * x[i, h])


def test_grouped_gate_first_rms_norm_matches_granite():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated

    gen = torch.Generator().manual_seed(5)
    x, z = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    norm = GraniteMoeHybridRMSNormGated(16, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen))
        got = ref.rms_norm_gated(x, z, norm.weight, 1e-5, norm_before_gate=False, group_size=8)
        torch.testing.assert_close(got, norm(x, z))


def _scan_inputs(gen: torch.Generator, lens: list[int], dim: int = 12, n: int = 5):
    t = sum(lens)
    x = torch.randn(t, dim, generator=gen)
    dt = F.softplus(torch.randn(t, dim, generator=gen))
    A = -torch.rand(dim, n, generator=gen) * 2 - 0.1
    B, C = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    D = torch.randn(dim, generator=gen)
    state = torch.randn(len(lens), dim, n, generator=gen) * 0.3
    return x, dt, A, B, C, D, state, _qsl(lens)


#: The Mamba scans' inputs and seed bases (the seed adds the chunk size).
MAMBA_SCANS = {"mamba2_ssd": (_ssd_inputs, 10), "mamba1_scan": (_scan_inputs, 20)}


@pytest.mark.parametrize(
    ("op", "chunk"), [("mamba2_ssd", c) for c in (3, 16, 256)] + [("mamba1_scan", c) for c in (1, 5, 16, 256)]
)
def test_mamba_scan_chunked_equals_its_recursion(op, chunk):
    inputs, seed = MAMBA_SCANS[op]
    gen = torch.Generator().manual_seed(seed + chunk)
    x, dt, A, B, C, D, state, qsl = inputs(gen, [1, 21, 40, 7])
    s_chunked = state.clone()
    out = getattr(ref, op)(x, dt, A, B, C, D, s_chunked, qsl, chunk)
    step = getattr(ref, f"{op}_step")
    want, s_want = _step_by_step(
        lambda sl, s: step(x[sl], dt[sl], A, B[sl], C[sl], D, s), torch.full_like(x, float("nan")), state, qsl
    )
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chunked, s_want, rtol=1e-4, atol=1e-4)


def test_mamba1_step_is_the_selective_recursion():
    gen = torch.Generator().manual_seed(6)
    x, dt, A, B, C, D, state, _ = _scan_inputs(gen, [1, 1, 1])
    s = state.clone()
    y = ref.mamba1_scan_step(x, dt, A, B, C, D, s)
    for i in range(3):
        for d in range(x.shape[1]):
            new = torch.exp(dt[i, d] * A[d]) * state[i, d] + dt[i, d] * x[i, d] * B[i]
            torch.testing.assert_close(s[i, d], new)
            torch.testing.assert_close(y[i, d], new @ C[i] + D[d] * x[i, d])


def test_mamba1_scan_and_step_match_transformers_jamba():
    """transformers' slow path: its scan from a zero state (prefill), then its one-step
    update continuing the returned state (decode)."""
    from transformers.models.jamba import modeling_jamba as hf

    gen = torch.Generator().manual_seed(7)
    x, dt, A, B, C, D, _, _ = _scan_inputs(gen, [23])
    state = torch.zeros(1, x.shape[1], A.shape[1])
    got = ref.mamba1_scan(x[:-1], dt[:-1], A, B[:-1], C[:-1], D, state, torch.tensor([0, 22], dtype=torch.int32))
    want, hf_state = hf.mamba_selective_scan(
        x[:-1].t()[None], dt[:-1].t()[None], A, B[:-1].t()[None], C[:-1].t()[None], D, return_last_state=True
    )
    torch.testing.assert_close(got, want[0].t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, hf_state, rtol=1e-4, atol=1e-4)
    got_step = ref.mamba1_scan_step(x[-1:], dt[-1:], A, B[-1:], C[-1:], D, state)
    want_step = hf.mamba_selective_state_update(hf_state, x[-1:], dt[-1:], A, B[-1:], C[-1:], D)
    torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, hf_state, rtol=1e-4, atol=1e-4)
