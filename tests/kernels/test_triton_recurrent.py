"""The Triton decode-step kernels of the recurrent layers against kernels/reference.py.

Runs under Triton's interpreter without a GPU (TRITON_INTERPRET=1, set before triton is
imported) and on the GPU when there is one.  Outputs are poisoned with NaN first; the
in-place float32 states are compared too, over GQA-style head ratios and sizes that are
not powers of two (masked lanes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import recurrent  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _gen(extra: int) -> torch.Generator:
    seed = int(os.environ.get("PAGEDSERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed ^ extra)


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "hk", "hv", "dk", "dv", "l2"), [(1, 2, 4, 16, 24, True), (5, 3, 3, 12, 10, False)])
def test_gated_delta_rule_step(dtype, seqs, hk, hv, dk, dv, l2):
    gen = _gen(1)
    q, k = torch.randn(seqs, hk, dk, generator=gen).to(dtype), torch.randn(seqs, hk, dk, generator=gen).to(dtype)
    v = torch.randn(seqs, hv, dv, generator=gen).to(dtype)
    g, beta = -F.softplus(torch.randn(seqs, hv, generator=gen)), torch.sigmoid(torch.randn(seqs, hv, generator=gen))
    state = torch.randn(seqs, hv, dk, dv, generator=gen) * 0.3
    want_state = state.clone()
    want = reference.gated_delta_rule_recurrent(q, k, v, g, beta, want_state, l2)
    got_state = state.clone().to(DEVICE)
    got = recurrent.gated_delta_rule_recurrent_triton(*_dev(q, k, v, g, beta), got_state, l2)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "heads", "groups", "p", "n"), [(1, 4, 2, 16, 8), (6, 6, 3, 10, 5)])
def test_mamba2_ssd_step(dtype, seqs, heads, groups, p, n):
    gen = _gen(2)
    x = torch.randn(seqs, heads, p, generator=gen).to(dtype)
    dt = F.softplus(torch.randn(seqs, heads, generator=gen))
    A = -(torch.rand(heads, generator=gen) * 2 + 0.1)
    B, C = torch.randn(seqs, groups, n, generator=gen).to(dtype), torch.randn(seqs, groups, n, generator=gen).to(dtype)
    D = torch.randn(heads, generator=gen)
    state = torch.randn(seqs, heads, p, n, generator=gen) * 0.3
    want_state = state.clone()
    want = reference.mamba2_ssd_step(x, dt, A, B, C, D, want_state)
    got_state = state.clone().to(DEVICE)
    got = recurrent.mamba2_ssd_step_triton(*_dev(x, dt, A, B, C, D), got_state)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "dim", "n"), [(1, 24, 8), (5, 300, 5)])
def test_mamba1_scan_step(dtype, seqs, dim, n):
    gen = _gen(4)
    x = torch.randn(seqs, dim, generator=gen).to(dtype)
    dt = F.softplus(torch.randn(seqs, dim, generator=gen))
    A = -(torch.rand(dim, n, generator=gen) * 2 + 0.1)
    B, C = torch.randn(seqs, n, generator=gen).to(dtype), torch.randn(seqs, n, generator=gen).to(dtype)
    D = torch.randn(dim, generator=gen)
    state = torch.randn(seqs, dim, n, generator=gen) * 0.3
    want_state = state.clone()
    want = reference.mamba1_scan_step(x, dt, A, B, C, D, want_state)
    got_state = state.clone().to(DEVICE)
    got = recurrent.mamba1_scan_step_triton(*_dev(x, dt, A, B, C, D), got_state)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "dim", "width", "bias", "act"), [(1, 24, 4, True, "silu"), (4, 300, 3, False, None)])
def test_causal_conv1d_update(dtype, seqs, dim, width, bias, act):
    gen = _gen(3)
    x, w = torch.randn(seqs, dim, generator=gen).to(dtype), torch.randn(dim, width, generator=gen).to(dtype)
    b = torch.randn(dim, generator=gen).to(dtype) if bias else None
    state = torch.randn(seqs, dim, width - 1, generator=gen)
    want_state = state.clone()
    want = reference.causal_conv1d_update(x, w, b, want_state, act)
    got_state = state.clone().to(DEVICE)
    got = recurrent.causal_conv1d_update_triton(*_dev(x, w), None if b is None else b.to(DEVICE), got_state, act)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state.cpu(), want_state)


def test_launchers_refuse_a_wrong_state():
    q = torch.randn(2, 2, 8, device=DEVICE)
    v = torch.randn(2, 4, 8, device=DEVICE)
    g = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="state"):
        recurrent.gated_delta_rule_recurrent_triton(q, q, v, g, g, torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="conv_state"):
        recurrent.causal_conv1d_update_triton(v[:, 0], torch.randn(8, 4), None, torch.zeros(2, 8, 2))
