"""The CPU ``gguf_linear`` op's shortcut for 2-D activations (every linear of a decode
step) gives exactly what its general path gives: the same kernel, the same dtype, the
same bytes (the kernel's own output), whatever the weight's layout, bias, row count and
dtype."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import ACT_Q_TOL, TOL, random_gguf, rel_err

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant

pytestmark = pytest.mark.skipif(load_quant_kernels() is None, reason="quantized CPU kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_two_dimensional_rows_match_the_general_path(type_name, dtype):
    gen = torch.Generator().manual_seed(5)
    k, n = 96, 48
    data = random_gguf(type_name, n, k, gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    bias = torch.randn(n, generator=gen).to(dtype)
    tid = ref.GGUF_TYPE_IDS[type_name]
    for m in (1, 4, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for w in (data, packed):
            for b in (None, bias):
                got = cpu_quant.gguf_linear(x, w, type_name, b)
                kernel = load_quant_kernels().gguf_linear_out(x, w, tid, b)
                assert got.dtype == dtype and got.shape == (m, n)
                assert torch.equal(got, kernel), (m, w.dim(), b is None)
                if w.dim() == 3:
                    # The general path (a leading dimension: reshapes and a cast) on
                    # repacked blocks, which only the kernel reads.
                    general = cpu_quant.gguf_linear(x.unsqueeze(0), w, type_name, b)[0]
                    assert torch.equal(got, general), (m, b is None)
                assert rel_err(got, ref.gguf_linear(x, data, type_name, b)) < ACT_Q_TOL + TOL[dtype]


def test_other_dtypes_still_take_the_general_path():
    """float16 rows: the file's blocks go to the reference, repacked ones to the kernel
    on widened rows, and the result comes back in float16."""
    gen = torch.Generator().manual_seed(6)
    data = random_gguf("Q4_1", 32, 64, gen)
    x = torch.randn(3, 64, generator=gen).half()
    got = cpu_quant.gguf_linear(x, data, "Q4_1")
    assert got.dtype == torch.float16 and torch.equal(got, ref.gguf_linear(x, data, "Q4_1"))
    packed = cpu_quant.prepare_gguf_weight(data, "Q4_1")
    if packed.dim() == 3:
        want = load_quant_kernels().gguf_linear_out(x.float(), packed, ref.GGUF_TYPE_IDS["Q4_1"]).half()
        assert torch.equal(cpu_quant.gguf_linear(x, packed, "Q4_1"), want)
