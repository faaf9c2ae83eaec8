"""The lora_linear op: the reference against a per-row computation, and the
conformance cases (core/testing/op_checks.py) catching broken implementations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from native_build import require_native

from pagedserve.kernels import reference
from pagedserve.testing.op_checks import OP_CASES


def per_row(y, x, a, b, slots):
    out = y.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] += (b[s].double() @ (a[s].double() @ x[i].double())).to(y.dtype)
    return out


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_reference_equals_per_row(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    a = torch.randn(3, 8, 48, generator=g)
    b = torch.randn(3, 40, 8, generator=g)
    slots = torch.randint(-1, 3, (rows,), generator=g)
    y = torch.randn(rows, 40, generator=g)
    want = per_row(y, x, a, b, slots)
    got = y.clone()
    assert reference.lora_linear(got, x, a, b, slots) is got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[slots < 0], y[slots < 0])


def run_cases(fn, dtype=torch.float32):
    target = SimpleNamespace(device=torch.device("cpu"))
    for _desc, body in OP_CASES["lora_linear"](target, fn, dtype, 0):
        body()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_cases_pass_reference(dtype):
    run_cases(reference.lora_linear, dtype)


def test_conformance_cases_catch_bugs():
    def wrong_slot(y, x, a, b, slots):  # every row takes adapter 0
        return reference.lora_linear(y, x, a, b, torch.where(slots >= 0, 0, -1))

    def ignores_view(y, x, a, b, slots):  # writes a contiguous copy, not the caller's view
        return reference.lora_linear(y.contiguous().clone(), x, a, b, slots)

    def touches_base_rows(y, x, a, b, slots):
        y[slots < 0] += 1e-3
        return reference.lora_linear(y, x, a, b, slots)

    for bad in (wrong_slot, ignores_view, touches_base_rows):
        with pytest.raises(AssertionError):
            run_cases(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_native_kernel_conforms(dtype):
    from pagedserve.kernels.cpu.lora_native import load_lora_kernels, lora_build_spec

    require_native(load_lora_kernels, lora_build_spec, "the LoRA CPU kernel")
    from pagedserve.platforms.cpu.lora_ops import lora_linear

    run_cases(load_lora_kernels().lora_linear, dtype)  # every size, past NATIVE_MAX_ROWS too
    run_cases(lora_linear, dtype)
    with pytest.raises(RuntimeError, match="outside"):
        lora_linear(
            torch.zeros(2, 4), torch.randn(2, 3), torch.randn(1, 2, 3), torch.randn(1, 4, 2), torch.tensor([0, 1])
        )
