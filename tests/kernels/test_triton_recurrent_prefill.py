"""The Triton prefill kernels of the recurrent layers (kernels/triton/recurrent_prefill.py)
against kernels/recurrent_reference.py.

Runs under Triton's interpreter without a GPU (TRITON_INTERPRET=1, set before triton is
imported) and on the GPU when there is one.  Inputs are fresh random tensors every run
(the seed is printed; PAGEDSERVE_TEST_SEED fixes it); varlen batches mix a one-token
sequence, one shorter than the convolution's window, sequences that start in the middle of a convolution tile and
lengths that are no multiple of the reference's chunk; states start non-zero (some
sequences fresh) and are compared after the call; every fresh tensor the launchers
allocate is NaN-filled.  The recurrent conformance cases (testing/recurrent_op_checks.py)
run over every Triton recurrent op, decode steps included, and every kernel is compiled
ahead of time for real GPU targets (the interpreter accepts code the compiler rejects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import recurrent_reference as ref  # noqa: E402
from pagedserve.kernels.triton import recurrent, recurrent_prefill  # noqa: E402
from pagedserve.testing.checks import Check  # noqa: E402
from pagedserve.testing.recurrent_op_checks import RECURRENT_CASES  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
#: Tokens per sequence: one token, fewer than a convolution window, lengths across a
#: 16-token convolution tile and past the reference's chunks, none a multiple of them.
LENS = (1, 2, 21, 3, 37)

TRITON_RECURRENT = {
    "gated_delta_rule_recurrent": recurrent.gated_delta_rule_recurrent_triton,
    "mamba2_ssd_step": recurrent.mamba2_ssd_step_triton,
    "mamba1_scan_step": recurrent.mamba1_scan_step_triton,
    "causal_conv1d_update": recurrent.causal_conv1d_update_triton,
    **recurrent_prefill.PREFILL_KERNELS,
}


def _gen(extra: int) -> torch.Generator:
    seed = int(os.environ.get("PAGEDSERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed ^ extra)


def _qsl(lens) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens).cumsum(0)
    return out


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``torch.empty_like`` in a launcher returns NaNs: an element the kernel
    forgets to write fails the comparison."""
    empty_like = torch.empty_like

    def nan_like(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", nan_like)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])


def _close_state(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol["atol"] * 10, rtol=tol["rtol"] * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("dim", "width", "bias", "act"), [(150, 4, True, "silu"), (24, 2, False, None), (40, 3, True, None)]
)
def test_causal_conv1d(poisoned, dtype, dim, width, bias, act):
    gen = _gen(11)
    x = torch.randn(sum(LENS), dim, generator=gen).to(dtype)
    w = torch.randn(dim, width, generator=gen).to(dtype)
    b = torch.randn(dim, generator=gen).to(dtype) if bias else None
    state = torch.randn(len(LENS), dim, width - 1, generator=gen)
    has = torch.tensor([True, False, True, False, True])  # fresh ones: zeros before their tokens
    want_state = state.clone()
    want = ref.causal_conv1d(x, w, b, want_state, _qsl(LENS), has, act)
    got_state = state.to(DEVICE)
    got = recurrent_prefill.causal_conv1d_triton(
        *_dev(x, w), None if b is None else b.to(DEVICE), got_state, *_dev(_qsl(LENS), has), act
    )
    _close(got, want, dtype)
    torch.testing.assert_close(got_state.cpu(), want_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "l2"), [(2, 4, 16, 40, True), (3, 3, 12, 10, False)])
def test_gated_delta_rule(poisoned, dtype, hk, hv, dk, dv, l2):
    gen = _gen(12)
    n = sum(LENS)
    q, k = (torch.randn(n, hk, dk, generator=gen).to(dtype) for _ in range(2))
    if not l2:  # unnormalised keys: keep the delta rule's writes contracting
        q, k = q * 0.3, k * 0.3
    v = torch.randn(n, hv, dv, generator=gen).to(dtype)
    g, beta = -F.softplus(torch.randn(n, hv, generator=gen)), torch.sigmoid(torch.randn(n, hv, generator=gen))
    state = torch.randn(len(LENS), hv, dk, dv, generator=gen) * 0.3
    state[2] = 0  # a fresh sequence
    want_state = state.clone()
    want = ref.gated_delta_rule(q, k, v, g, beta, want_state, _qsl(LENS), l2, 8)
    got_state = state.to(DEVICE)
    got = recurrent_prefill.gated_delta_rule_triton(*_dev(q, k, v, g, beta), got_state, _qsl(LENS).to(DEVICE), l2, 8)
    _close(got, want, dtype)
    _close_state(got_state, want_state, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "groups", "p", "n"), [(4, 2, 20, 12), (3, 1, 8, 16)])
def test_mamba2_ssd(poisoned, dtype, heads, groups, p, n):
    gen = _gen(13)
    t = sum(LENS)
    x = torch.randn(t, heads, p, generator=gen).to(dtype)
    dt = F.softplus(torch.randn(t, heads, generator=gen))
    A = -(torch.rand(heads, generator=gen) * 2 + 0.1)
    B, C = (torch.randn(t, groups, n, generator=gen).to(dtype) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    state = torch.randn(len(LENS), heads, p, n, generator=gen) * 0.3
    want_state = state.clone()
    want = ref.mamba2_ssd(x, dt, A, B, C, D, want_state, _qsl(LENS), 8)
    got_state = state.to(DEVICE)
    got = recurrent_prefill.mamba2_ssd_triton(*_dev(x, dt, A, B, C, D), got_state, _qsl(LENS).to(DEVICE), 8)
    _close(got, want, dtype)
    _close_state(got_state, want_state, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "n"), [(70, 5), (16, 16)])
def test_mamba1_scan(poisoned, dtype, dim, n):
    gen = _gen(14)
    t = sum(LENS)
    x = torch.randn(t, dim, generator=gen).to(dtype)
    dt = F.softplus(torch.randn(t, dim, generator=gen))
    A = -(torch.rand(dim, n, generator=gen) * 2 + 0.1)
    B, C = (torch.randn(t, n, generator=gen).to(dtype) for _ in range(2))
    D = torch.randn(dim, generator=gen)
    state = torch.randn(len(LENS), dim, n, generator=gen) * 0.3
    want_state = state.clone()
    want = ref.mamba1_scan(x, dt, A, B, C, D, want_state, _qsl(LENS), 4)
    got_state = state.to(DEVICE)
    got = recurrent_prefill.mamba1_scan_triton(*_dev(x, dt, A, B, C, D), got_state, _qsl(LENS).to(DEVICE), 4)
    _close(got, want, dtype)
    _close_state(got_state, want_state, dtype)


def test_prefill_then_decode_continues_the_states():
    """A prefill of the Triton kernels then a decode step of them on the same states
    gives the reference's prefill over every token at once."""
    gen = _gen(15)
    lens = (6, 1, 18)
    q, k = (torch.randn(sum(lens) + 3, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(sum(lens) + 3, 2, 8, generator=gen)
    g, beta = -F.softplus(torch.randn(sum(lens) + 3, 2, generator=gen)), torch.rand(sum(lens) + 3, 2, generator=gen)
    state = torch.randn(3, 2, 16, 8, generator=gen) * 0.3
    # Reference: each sequence's prompt and its one decoded token as one sequence.
    order = [*range(6), 25, 6, 26, *range(7, 25), 27]
    full = _qsl([7, 2, 19])
    want_state = state.clone()
    want = ref.gated_delta_rule(*(t[order] for t in (q, k, v, g, beta)), want_state, full)
    got_state = state.to(DEVICE)
    n = sum(lens)
    pre = recurrent_prefill.gated_delta_rule_triton(
        *_dev(q[:n], k[:n], v[:n], g[:n], beta[:n]), got_state, _qsl(lens).to(DEVICE)
    )
    step = recurrent.gated_delta_rule_recurrent_triton(*_dev(q[n:], k[n:], v[n:], g[n:], beta[n:]), got_state)
    got = torch.cat([pre.cpu(), step.cpu()])[order]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype", [torch.float32, *(pytest.param(d, marks=pytest.mark.slow) for d in (torch.bfloat16, torch.float16))]
)
def test_triton_recurrent_ops_pass_the_conformance_cases(dtype):
    """The conformance kit's cases (testing/recurrent_op_checks.py: odd shapes, a fresh
    sequence, NaN-filled allocator blocks) on every Triton recurrent op (bf16 and fp16
    marked slow: the tests above cover bf16 at other shapes)."""
    target = types.SimpleNamespace(device=torch.device(DEVICE))
    failures = []
    for op, fn in TRITON_RECURRENT.items():
        cases = list(RECURRENT_CASES[op](target, fn, dtype, 0))
        assert len(cases) >= 3, op
        for desc, body in cases:
            result = Check(f"{op}[{desc}]", body).run()
            if result.status != "passed":
                failures.append(f"{op}[{desc}]: {result.message}")
    assert not failures, "\n".join(failures)


def test_launchers_refuse_what_they_cannot_serve():
    x = torch.randn(5, 8, device=DEVICE)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([True, False], device=DEVICE)
    w = torch.randn(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="conv_state"):
        recurrent_prefill.causal_conv1d_triton(x, w, None, torch.zeros(2, 8, 2, device=DEVICE), qsl, has)
    with pytest.raises(ValueError, match="state must be contiguous"):
        state = torch.zeros(2, 3, 8, device=DEVICE).transpose(1, 2)
        recurrent_prefill.causal_conv1d_triton(x, w, None, state, qsl, has)
    with pytest.raises(ValueError, match="activation"):
        recurrent_prefill.causal_conv1d_triton(x, w, None, torch.zeros(2, 8, 3, device=DEVICE), qsl, has, "gelu")
    q, v = torch.randn(5, 2, 8, device=DEVICE), torch.randn(5, 4, 8, device=DEVICE)
    g = torch.zeros(5, 4, device=DEVICE)
    with pytest.raises(ValueError, match="state has dtype bfloat16"):
        bad = torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16, device=DEVICE)
        recurrent_prefill.gated_delta_rule_triton(q, q, v, g, g, bad, qsl)
    with pytest.raises(ValueError, match=r"state must be \[2, 4, 8, 8\]"):
        recurrent_prefill.gated_delta_rule_triton(q, q, v, g, g, torch.zeros(3, 4, 8, 8, device=DEVICE), qsl)
    with pytest.raises(ValueError, match="query_start_loc"):
        recurrent_prefill.mamba1_scan_triton(
            x, x, torch.randn(8, 4), x[:, :4], x[:, :4], torch.randn(8), torch.zeros(2, 8, 4), qsl.float()
        )


def test_cuda_and_rocm_register_every_recurrent_kernel(monkeypatch):
    from pagedserve.platforms.cuda import ops as cuda_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.rocm.ops import register_rocm_ops

    monkeypatch.delenv("PAGEDSERVE_CUDA_KERNELS", raising=False)
    for register in (cuda_ops.register_cuda_ops, register_rocm_ops):
        ops = OpRegistry()
        register(ops)
        for name, fn in TRITON_RECURRENT.items():
            assert ops.source(name) == "triton", (register.__name__, name)
            assert getattr(ops, name) is fn
        assert ops.source("rms_norm_gated") == "reference"
    # PAGEDSERVE_CUDA_KERNELS=cuda keeps the Triton recurrent kernels (no CUDA C++ ones).
    assert set(TRITON_RECURRENT) <= set(cuda_ops._RECURRENT_OPS)


# Ahead-of-time compilation for real GPU targets, in a subprocess without the interpreter.
_AOT_SCRIPT = r"""
import json, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.kernels.triton import recurrent as dec, recurrent_prefill as pre

FP32_PTRS = {"state_ptr", "a_ptr", "d_ptr", "g_ptr", "beta_ptr", "dt_ptr"}
INT_PTRS = {"qsl_ptr", "has_ptr"}

def signature(fn, dtype):
    sig = {}
    for name in fn.arg_names:
        if name.isupper() and name != "NUM_SEQS":
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in FP32_PTRS else dtype
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig

gdn = dict(HK=16, HV=32, DK=128, DV=128, BK=128, L2NORM=True)
# (name, kernel, constexprs, warps): the launchers' choices at published models' shapes.
jobs = [
    ("conv", pre._conv_kernel, dict(DIM=8192, W=4, HAS_BIAS=True, SILU=True, BLOCK_T=16, BLOCK_C=128), 4),
    ("conv-window", pre._conv_window_kernel, dict(DIM=8192, W=4, WP=4, BLOCK_C=128), 4),
    ("gdn", pre._gdn_kernel, dict(gdn, BV=8), 1),
    ("ssd", pre._ssd_kernel, dict(H=48, G=1, P=64, N=128, BP=4, BN=128), 4),
    ("scan", pre._scan_kernel, dict(DIM=8192, N=16, BD=32, BN=16), 1),
    ("gdn-step", dec._gdn_step_kernel, dict(gdn, BV=128), 4),
    ("ssd-step", dec._ssd_step_kernel, dict(H=48, G=1, P=64, N=128, BP=64, BN=128), 4),
    ("scan-step", dec._scan_step_kernel, dict(DIM=8192, N=16, BD=256, BN=16), 4),
    ("conv-step", dec._conv_update_kernel, dict(DIM=8192, W=4, HAS_BIAS=False, SILU=True, BLOCK=256), 4),
]
targets = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32),
           "gfx942": GPUTarget("hip", "gfx942", 64)}
results = {}
for tname, target in targets.items():
    for name, fn, consts, warps in jobs:
        try:
            compiled = triton.compile(ASTSource(fn, signature(fn, "*bf16"), consts), target=target,
                                      options={"num_warps": warps})
            results[f"{tname}:{name}"] = "ok" if compiled.asm else "empty"
        except Exception as exc:
            results[f"{tname}:{name}"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def aot_results() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=REPO_ROOT
    )
    if res.returncode != 0:
        pytest.fail(f"AOT compile script failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["sm80", "sm90", "gfx942"])
def test_recurrent_kernels_compile_for_gpu_targets(target, aot_results):
    mine = {k: v for k, v in aot_results.items() if k.startswith(target + ":")}
    assert len(mine) == 9, mine
    if target == "gfx942" and all("backend" in v.lower() for v in mine.values()):
        pytest.skip("this triton build has no AMD backend")
    failed = {k: v for k, v in mine.items() if v != "ok"}
    assert not failed, json.dumps(failed, indent=1)
