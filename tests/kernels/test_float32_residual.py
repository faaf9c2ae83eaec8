"""``fused_add_rms_norm`` with a float32 residual stream beside narrower activations.

The reference's mixed case (a float32 residual beside a bf16/fp16 ``x``, or a float32
``x`` whose row comes back in ``out_dtype``) against a float64 computation of the same
definition, then the native CPU kernel (every instruction set runnable here) against
the reference, on fresh random inputs.  The residual is updated in place; the row
goes into ``x`` where x is of ``out_dtype``, else into a new tensor.
"""

from __future__ import annotations

import pytest
import torch
from native_build import native_build_failed

from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu import ISA_ORDER, NativeCpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu.native import ISA_FEATURES
from pagedserve.platforms.ops import FLOAT32_RESIDUAL, OpRegistry

pytestmark = pytest.mark.timeout(600)

NARROW = (torch.bfloat16, torch.float16)
SHAPES = [(1, 576), (7, 3, 577), (300, 64)]
#: The row is rounded once to a 16-bit type: one unit in its last place, either way.
ROW_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=8e-3), torch.float16: dict(atol=1e-3, rtol=1e-3)}


def _inputs(shape, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    residual = torch.randn(shape, generator=gen) * 2
    weight = (1 + torch.randn(shape[-1], generator=gen) * 0.1).to(w_dtype)
    return x, residual, weight


@pytest.mark.parametrize("out_dtype", NARROW)
@pytest.mark.parametrize("x_float32", [False, True], ids=["x-narrow", "x-float32"])
def test_reference_mixed_case_is_the_float32_definition(out_dtype, x_float32):
    """Sum in float32 (exactly x + residual), the row times weight in float32 (checked in
    float64) rounded once to out_dtype."""
    x, residual, weight = _inputs((9, 200), torch.float32 if x_float32 else out_dtype, out_dtype, 1)
    normed, res = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, out_dtype=out_dtype)
    assert res.dtype == torch.float32 and torch.equal(res, residual + x.float())
    r64 = res.double()
    want = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert normed.dtype == out_dtype
    torch.testing.assert_close(normed.double(), want.to(out_dtype).double(), **ROW_TOL[out_dtype])


def test_reference_same_dtype_case_is_unchanged():
    """Without a float32 residual (or with out_dtype x's dtype) the op rounds as before."""
    x, _, weight = _inputs((5, 64), torch.bfloat16, torch.bfloat16, 2)
    residual = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    plain = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    same = reference.fused_add_rms_norm(x, residual, weight, 1e-5, out_dtype=torch.bfloat16)
    summed = x + residual
    assert torch.equal(plain[1], summed) and torch.equal(plain[0], reference.rms_norm(summed, weight, 1e-5))
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])


def test_reference_refuses_a_narrow_residual_beside_other_dtypes():
    x, _, weight = _inputs((2, 32), torch.float32, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="only a float32 residual"):
        reference.fused_add_rms_norm(x, torch.randn(2, 32).to(torch.bfloat16), weight, 1e-5)


def test_reference_op_declares_the_capability():
    assert OpRegistry().has_capability("fused_add_rms_norm", FLOAT32_RESIDUAL)


@pytest.fixture(scope="module")
def module():
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return mod


@pytest.fixture(scope="module", params=ISA_ORDER)
def kernels(request, module) -> NativeCpuKernels:
    features = build.read_cpu_features()
    runnable = [i for i in module.compiled_isas() if not features or ISA_FEATURES[i] <= features]
    if request.param not in runnable:
        pytest.skip(f"{request.param} is not compiled in or not supported by this CPU")
    return load_cpu_kernels(isa=request.param)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", NARROW)
@pytest.mark.parametrize("x_float32", [False, True], ids=["x-narrow", "x-float32"])
def test_native_matches_reference(kernels, shape, out_dtype, x_float32):
    x, residual, weight = _inputs(shape, torch.float32 if x_float32 else out_dtype, out_dtype, sum(shape))
    want_row, want_res = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, out_dtype=out_dtype)
    x_in, res_in = x.clone(), residual.clone()
    row, res = kernels.fused_add_rms_norm(x_in, res_in, weight, 1e-5, out_dtype=None if not x_float32 else out_dtype)
    # The residual is the same float32 additions: bit for bit, in place.
    assert res is res_in and torch.equal(res, want_res)
    assert row.dtype == out_dtype and row.shape == x.shape
    if not x_float32:
        assert row is x_in  # the row written over x (same dtype)
    torch.testing.assert_close(row, want_row, **ROW_TOL[out_dtype])
    # At most one unit in the last place from the reference (a different sum order of the squares).
    ulp = (row.float() - want_row.float()).abs() / want_row.float().abs().clamp_min(1e-3)
    assert ulp.max().item() <= (2**-7 if out_dtype == torch.bfloat16 else 2**-10) + 1e-6


def test_native_float32_weight_is_cast_to_the_row_dtype(kernels):
    """A float32 norm weight beside a bf16 row (a caller's choice) is the row dtype's weight."""
    x, residual, weight = _inputs((4, 128), torch.float32, torch.float32, 7)
    row, _ = kernels.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, out_dtype=torch.bfloat16)
    want, _ = reference.fused_add_rms_norm(x, residual.clone(), weight.to(torch.bfloat16), 1e-5, torch.bfloat16)
    torch.testing.assert_close(row, want, **ROW_TOL[torch.bfloat16])


def test_native_overlapping_inputs_take_the_reference(kernels):
    """x viewing the residual's own bytes cannot run in place: the reference answers."""
    residual = torch.empty(4, 64)
    halves = residual.view(-1).view(torch.bfloat16)  # its bytes as 512 bf16 values (finite ones)
    halves.copy_(torch.randn(512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16))
    x = halves[: 4 * 64].view(4, 64)  # the first half of the residual's bytes
    weight = (torch.rand(64) + 0.5).to(torch.bfloat16)
    want = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    got = kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_cpu_platform_declares_the_capability_and_passes_the_kit():
    """The CPU platform's fused_add_rms_norm declares ``float32_residual`` and passes the
    conformance kit's float32-residual cases."""
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    assert target.ops.has_capability("fused_add_rms_norm", FLOAT32_RESIDUAL)
    checks = [c for c in op_checks(target) if c.id.startswith("op:fused_add_rms_norm[") and "float32-residual" in c.id]
    assert len(checks) >= 8  # 2 narrow dtypes x 4 cases
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)
