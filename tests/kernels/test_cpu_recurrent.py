"""The native CPU kernels of the recurrent-layer ops (kernels/cpu/recurrent.cpp) against
the torch references: the conformance cases in every dtype, the inputs the models pass
(strided views of one projection), the CPU platform registering them, and what the
kernels hand to the reference or refuse."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from native_build import require_native

from pagedserve.kernels import build
from pagedserve.kernels import recurrent_reference as ref
from pagedserve.testing.checks import Check
from pagedserve.testing.recurrent_op_checks import RECURRENT_CASES
from pagedserve.testing.target import select_target

pytestmark = pytest.mark.skipif(build.no_compiler_declared(), reason="PAGEDSERVE_NO_COMPILER=1")


@pytest.fixture(scope="module")
def native():
    from pagedserve.kernels.cpu import recurrent_native

    require_native(
        recurrent_native.load_recurrent_kernels, recurrent_native.recurrent_build_spec, "the recurrent CPU kernels"
    )
    return recurrent_native


@pytest.fixture
def no_reference(native, monkeypatch):
    """The native entry points' fallback raises: a call that silently went to the
    reference would fail the test (the cases' own reference is untouched)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran instead of the native kernel")

    monkeypatch.setattr(native, "ref", types.SimpleNamespace(**{n: refuse for n in ref.RECURRENT_OP_NAMES}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_kernels_pass_the_conformance_cases(native, no_reference, dtype):
    target = select_target("cpu")
    failures = []
    for op, fn in native.OPS.items():
        cases = list(RECURRENT_CASES[op](target, fn, dtype, 0))
        assert len(cases) >= 3, op
        for desc, body in cases:
            result = Check(f"{op}[{desc}]", body).run()
            if result.status != "passed":
                failures.append(f"{op}[{desc}]: {result.message}")
    assert not failures, "\n".join(failures)


def test_native_kernels_run_without_the_reference(native, no_reference):
    """Inputs of the models' kinds (no bias, both activations, a decode step after a
    prefill on the same states) take the native path."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    v = torch.randn(4, 4, 24, generator=gen)
    g, beta = -F.softplus(torch.randn(4, 4, generator=gen)), torch.rand(4, 4, generator=gen)
    state = torch.randn(2, 4, 16, 24, generator=gen)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    native.gated_delta_rule(q, k, v, g, beta, state, qsl)
    native.gated_delta_rule_recurrent(q[:2], k[:2], v[:2], g[:2], beta[:2], state)
    x, dt = torch.randn(4, 4, 8, generator=gen), F.softplus(torch.randn(4, 4, generator=gen))
    B, C = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    s2 = torch.randn(2, 4, 8, 8, generator=gen)
    native.mamba2_ssd(x, dt, -torch.rand(4), B, C, torch.randn(4), s2, qsl)
    native.mamba2_ssd_step(x[:2], dt[:2], -torch.rand(4), B[:2], C[:2], torch.randn(4), s2)
    x1, dt1 = torch.randn(4, 12, generator=gen), F.softplus(torch.randn(4, 12, generator=gen))
    s1 = torch.randn(2, 12, 8, generator=gen)
    native.mamba1_scan(x1, dt1, -torch.rand(12, 8), B[:, 0], C[:, 0], torch.randn(12), s1, qsl)
    native.mamba1_scan_step(x1[:2], dt1[:2], -torch.rand(12, 8), B[:2, 0], C[:2, 0], torch.randn(12), s1)
    cs = torch.randn(2, 12, 3, generator=gen)
    native.causal_conv1d(x1, torch.randn(12, 4), None, cs, qsl, torch.tensor([True, False]), "silu")
    native.causal_conv1d_update(x1[:2], torch.randn(12, 4), torch.randn(12), cs, None)
    native.rms_norm_gated(x1, x1, torch.ones(12), 1e-5, False, 4)


def test_strided_views_like_the_models_pass(native):
    """Qwen3.5 splits one projection into q, k, v (row-strided views) and passes a bf16
    weight; Mamba 2 splits x, B and C out of the convolution's output."""
    gen = torch.Generator().manual_seed(4)
    n, hk, hv, dk, dv = 7, 2, 4, 16, 24
    mixed = torch.randn(n, 2 * hk * dk + hv * dv + 5, generator=gen).to(torch.bfloat16)
    q, k, v = mixed[:, : 2 * hk * dk + hv * dv].split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    assert not q.is_contiguous()
    g, beta = -F.softplus(torch.randn(n, hv, generator=gen)), torch.rand(n, hv, generator=gen)
    state = torch.randn(2, hv, dk, dv, generator=gen) * 0.3
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    want_state = state.clone()
    want = ref.gated_delta_rule(q, k, v, g, beta, want_state, qsl)
    got = native.gated_delta_rule(q, k, v, g, beta, state, qsl)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, want_state, atol=1e-3, rtol=1e-3)

    width, dim = 4, mixed.shape[1] - 5
    conv_state = torch.randn(2, dim, width - 1, generator=gen)
    weight = torch.randn(dim, width, generator=gen).to(torch.bfloat16)
    has = torch.tensor([True, False])
    want_cs = conv_state.clone()
    want = ref.causal_conv1d(mixed[:, :dim], weight, None, want_cs, qsl, has, "silu")
    got = native.causal_conv1d(mixed[:, :dim], weight, None, conv_state, qsl, has, "silu")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(conv_state, want_cs, atol=0, rtol=0)  # the window holds the inputs exactly

    heads, hd, groups, ds = 4, 8, 2, 16
    xbc = torch.randn(n, heads * hd + 2 * groups * ds, generator=gen)
    xs, B, C = xbc.split([heads * hd, groups * ds, groups * ds], dim=-1)
    xs, B, C = xs.reshape(n, heads, hd), B.reshape(n, groups, ds), C.reshape(n, groups, ds)
    dt, A, D = F.softplus(torch.randn(n, heads, generator=gen)), -torch.rand(heads) - 0.1, torch.randn(heads)
    s = torch.randn(2, heads, hd, ds, generator=gen) * 0.3
    want_s = s.clone()
    want = ref.mamba2_ssd(xs, dt, A, B, C, D, want_s, qsl, 4)
    torch.testing.assert_close(native.mamba2_ssd(xs, dt, A, B, C, D, s, qsl, 4), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


def test_long_sequences_keep_the_state_accurate(native):
    """A 600-token DeltaNet sequence at Qwen3.5's head size (token by token against the
    chunked reference): the float32 rounding of the two orders stays far inside the
    tolerance."""
    gen = torch.Generator().manual_seed(5)
    n, h, d = 600, 2, 128
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    g, beta = -F.softplus(torch.randn(n, h, generator=gen)) * 0.1, torch.rand(n, h, generator=gen)
    state = torch.zeros(1, h, d, d)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    want_state = state.clone()
    want = ref.gated_delta_rule(q, k, v, g, beta, want_state, qsl)
    got = native.gated_delta_rule(q, k, v, g, beta, state, qsl)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state, want_state, atol=2e-4, rtol=2e-4)


def test_inputs_the_kernels_do_not_take_go_to_the_reference(native):
    gen = torch.Generator().manual_seed(6)
    x, dt = torch.randn(3, 12, generator=gen), F.softplus(torch.randn(3, 12, generator=gen))
    A, B, C, D = -torch.rand(12, 8), torch.randn(3, 8), torch.randn(3, 8), torch.randn(12)
    # A state that is not contiguous: the reference updates it in place through copy_.
    base = torch.randn(3, 8, 12, generator=gen)
    state = base.transpose(1, 2)
    want_state = state.clone()
    want = ref.mamba1_scan_step(x, dt, A, B, C, D, want_state)
    got = native.mamba1_scan_step(x, dt, A, B, C, D, state)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, want_state)
    # Shapes that do not fit: the reference's own error.
    with pytest.raises(RuntimeError):
        native.mamba1_scan_step(x, dt, A, B[:, :5], C, D, torch.randn(3, 12, 8))
    # An activation nobody implements: the reference names it.
    with pytest.raises(ValueError, match="not supported"):
        native.causal_conv1d_update(x, torch.randn(12, 4), None, torch.randn(3, 12, 3), "gelu")


def test_query_start_loc_outside_the_tokens_is_refused(native):
    x, dt = torch.randn(4, 12), F.softplus(torch.randn(4, 12))
    qsl = torch.tensor([0, 2, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        native.mamba1_scan(x, dt, -torch.rand(12, 8), torch.randn(4, 8), torch.randn(4, 8), torch.randn(12),
                           torch.zeros(2, 12, 8), qsl)  # fmt: skip


def test_the_cpu_platform_registers_the_native_kernels():
    if not build.toolchain_available():
        pytest.skip("no C++ toolchain: the platform keeps the references")
    target = select_target("cpu")
    for op in ref.RECURRENT_OP_NAMES:
        assert target.ops.source(op) == "cpu-native-recurrent", op


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "isa"), [("-mavx2 -mfma -mf16c", "avx2"), ("", "portable")])
def test_avx2_and_portable_builds_pass_the_conformance_cases(native, monkeypatch, flags, isa):
    """The other instruction sets of vec.h (an AVX2 build, the portable generic vectors),
    built here with PAGEDSERVE_CPU_ARCH_FLAGS, on every case in float32 and bf16."""
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= build.read_cpu_features():
        pytest.skip("this CPU has no AVX2")
    target = select_target("cpu")  # before the flags change: the platform's own kernels stay as built
    monkeypatch.setenv("PAGEDSERVE_CPU_ARCH_FLAGS", flags)
    try:
        module = build.load_extension(native.recurrent_build_spec(), f"recurrent CPU kernels ({isa})")[0]
    except build.KernelBuildError as exc:
        pytest.fail(f"the {isa} build failed: {exc}")
    assert module.isa() == isa
    monkeypatch.setattr(native, "load_recurrent_kernels", lambda: module)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, fn in native.OPS.items():
            for desc, body in RECURRENT_CASES[op](target, fn, dtype, 1):
                result = Check(f"{op}[{desc}]", body).run()
                if result.status != "passed":
                    failures.append(f"{op}[{desc}] {dtype}: {result.message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_without_qk_normalisation(native, dtype):
    """use_qk_l2norm=False (q only scaled), prefill then decode on the same states."""
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(6, 3, 12, generator=gen).mul(0.3).to(dtype) for _ in range(2))
    v = torch.randn(6, 3, 10, generator=gen).to(dtype)
    g, beta = -F.softplus(torch.randn(6, 3, generator=gen)), torch.rand(6, 3, generator=gen)
    state = torch.randn(2, 3, 12, 10, generator=gen) * 0.3
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    want_state = state.clone()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    want = ref.gated_delta_rule(q[:4], k[:4], v[:4], g[:4], beta[:4], want_state, qsl, False)
    torch.testing.assert_close(
        native.gated_delta_rule(q[:4], k[:4], v[:4], g[:4], beta[:4], state, qsl, False), want, **tol
    )
    want = ref.gated_delta_rule_recurrent(q[4:], k[4:], v[4:], g[4:], beta[4:], want_state, False)
    got = native.gated_delta_rule_recurrent(q[4:], k[4:], v[4:], g[4:], beta[4:], state, False)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)
