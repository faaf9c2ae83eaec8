"""``gguf_linear(..., out_dtype=torch.float32)`` from bfloat16 activations: the float32
sums (+ bias) unrounded, for a projection writing into a float32 residual stream.

The native kernel's float32 output is bit for bit what it gives on a float32 copy of
the same activations (the int8 blocks are the same), and its bf16 output is exactly
that float32 output rounded; both against the reference on fresh random blocks, every
kept type, the file's blocks and the repacked form, outputs poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch
from gguf_type_checks import nan_outputs, native, random_blocks

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.platforms.ops import GGUF_OUT_DTYPE, OpRegistry
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _weights(type_name: str, n: int, k: int, seed: int) -> list[torch.Tensor]:
    """The file's blocks, and their repacked form where this build repacks the type."""
    data = random_blocks(type_name, n, k, torch.Generator().manual_seed(seed))
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    return [data] if packed is data else [data, packed]


@pytest.mark.parametrize("type_name", TYPES)
def test_native_float32_output_is_the_unrounded_sums(type_name):
    module = native()
    k, n = 512, 48  # 3 column groups of 16; K a multiple of the K-quants' 256
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    tid = ref.GGUF_TYPE_IDS[type_name]
    for w in _weights(type_name, n, k, 6):
        for m in (1, 3, 17, 70):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                with nan_outputs():
                    got = module.gguf_linear_out(x, w, tid, b, True)
                    same_values = module.gguf_linear_out(x.float(), w, tid, b)
                    rounded = module.gguf_linear_out(x, w, tid, b)
                assert got.dtype == torch.float32 and got.shape == (m, n)
                assert torch.equal(got, same_values), (m, w.dim(), b is None)
                assert torch.equal(got.to(torch.bfloat16), rounded), (m, w.dim(), b is None)


@pytest.mark.parametrize("type_name", TYPES)
def test_platform_op_matches_reference(type_name):
    native()
    k, n = 256, 32
    gen = torch.Generator().manual_seed(9)
    data = random_blocks(type_name, n, k, torch.Generator().manual_seed(10))
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = reference.gguf_linear(x, data, type_name, bias, torch.float32)
    assert want.dtype == torch.float32
    assert torch.equal(want, ref.gguf_linear(x.float(), data, type_name, bias))
    for w in _weights(type_name, n, k, 10):
        got = cpu_quant.gguf_linear(x, w, type_name, bias, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        # Only the int8 activation blocks' error remains (no bf16 rounding of y).
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel
        assert torch.equal(cpu_quant.gguf_linear(x, w, type_name, bias, out_dtype=torch.bfloat16), got.bfloat16())


def test_weight_apply_with_and_without_the_capability():
    """A GGUFWeight asks its op for out_dtype where the op declares it; otherwise it hands
    the op a float32 copy of x, whose float32 result is the same."""
    native()
    gen = torch.Generator().manual_seed(11)
    data = random_blocks("Q4_1", 32, 128, gen)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    calls: list[tuple] = []

    def plain_op(x, data, type_name, bias=None):  # a platform op of interface 1.6
        calls.append((x.dtype,))
        return cpu_quant.gguf_linear(x, data, type_name, bias)

    old = GGUFWeight("Q4_1", data, 128, op=plain_op, op_out_dtype=False)
    new = GGUFWeight("Q4_1", data, 128, op=cpu_quant.gguf_linear, op_out_dtype=True)
    a, b = old.apply(x, None, torch.float32), new.apply(x, None, torch.float32)
    assert calls == [(torch.float32,)] and a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(new.apply(x), b.bfloat16()) and new.apply(x).dtype == torch.bfloat16
    stacked = StackedWeight(
        [new, GGUFWeight("Q8_0", random_blocks("Q8_0", 16, 128, gen), 128, op=cpu_quant.gguf_linear)]
    )
    assert stacked.float32_accumulation
    y = stacked.apply(x, None, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y[:, :32], b)
    # The reference op takes out_dtype and declares it.
    assert GGUFWeight("Q4_1", data, 128).op_out_dtype and OpRegistry().has_capability("gguf_linear", GGUF_OUT_DTYPE)


def test_cpu_conformance_float32_output_cases():
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    if "gguf_linear" not in target.overridden_ops():
        pytest.skip("the CPU platform keeps the reference gguf_linear here")
    assert target.ops.has_capability("gguf_linear", GGUF_OUT_DTYPE)
    checks = [c for c in op_checks(target) if c.id.startswith("op:gguf_linear[") and "out-float32" in c.id]
    assert len(checks) >= 3 * 2  # base types x shapes, bfloat16 activations
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)
