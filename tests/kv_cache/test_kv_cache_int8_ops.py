"""int8 KV caches with a scale per token and KV head (kv_cache_dtype int8) at the op level.

An int8 cache row is ``head_size`` int8 values followed by the 4 bytes of a float32
scale (``absmax / 127``, computed on write; kernels/reference.py).  Here: the format's
rounding and scale, the row sizes core and the reference agree on, and the conformance
kit's int8 cases.  The write, every CPU attention implementation, dequantized blocks and
block copies on int8 caches (beside the fp8 kinds) are in test_kv_cache_8bit_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model_runner import kv_cache_torch_dtype, kv_row_size
from pagedserve.kernels import reference
from pagedserve.kv_cache import kv_dtype
from pagedserve.platforms.cpu.platform import CpuPlatform
from tests.kv_cache.kv8_inputs import gen_for

pytestmark = pytest.mark.timeout(600)

# ---- the format -----------------------------------------------------------------------


def test_quantize_kv_int8_rows_hold_values_then_their_scale():
    gen = gen_for("format")
    x = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 50
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 5] = 1e4  # one outlier sets its row's scale only
    rows = reference.quantize_kv_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (300, 3, 68)
    q, s = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 127)
    assert q.abs().max() == 127 and q.min() >= -127
    # Round half to even of the float32 quotient x / s (the specified rounding).
    want = torch.where(s > 0, x / s, torch.zeros_like(x)).round()
    assert torch.equal(q.float(), want)
    back = reference.dequantize_kv(rows, 64)
    assert torch.equal(back, q.float() * s)
    assert ((back - x).abs() <= s / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert (back[1, 0] - x[1, 0]).abs().max() < 0.2  # the outlier did not coarsen other rows
    with pytest.raises(ValueError, match="head_size \\+ 4 = 68"):
        reference.dequantize_kv(rows[..., :66], 64)


def test_row_sizes_agree_between_core_and_the_reference():
    assert kv_dtype.KV_SCALE_BYTES == reference.INT8_KV_SCALE_BYTES == 4
    for d in (64, 128):
        assert kv_row_size(d, torch.int8) == reference.kv_row_size(d, torch.int8) == d + 4
        assert kv_row_size(d, torch.bfloat16) == reference.kv_row_size(d, torch.bfloat16) == d
        # fp8 rows carry a scale too unless per-layer scales are used (test_kv_cache_fp8_rows_ops.py).
        assert kv_row_size(d, torch.float8_e4m3fn, False) == reference.kv_row_size(d, torch.float8_e4m3fn, False) == d
    assert kv_cache_torch_dtype("int8", torch.bfloat16) is torch.int8
    assert "int8" in CpuPlatform.kv_cache_dtypes


def test_gpu_platforms_declare_every_8bit_dtype():
    """Their Triton kernels (and the CUDA C++ ops, which hand 8-bit caches to Triton) read
    int8 and fp8 caches (tests/kernels/test_triton_int8_kv.py, test_triton_fp8_kv.py)."""
    from pagedserve.executor.model_runner import check_cache_dtype
    from pagedserve.platforms.cuda import CudaPlatform
    from pagedserve.platforms.rocm import RocmPlatform

    for cls in (CudaPlatform, RocmPlatform):
        assert set(cls.kv_cache_dtypes) == {"int8", "fp8_e4m3", "fp8_e5m2"}
        for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
            check_cache_dtype(name, torch.bfloat16, [cls])


# ---- the conformance kit's int8 cases --------------------------------------------------


def _kit_int8_cases(target, fn, dtype):
    from pagedserve.testing.op_checks import OP_CASES

    return [(d, b) for d, b in OP_CASES["paged_attention"](target, fn, dtype, 0) if d.startswith("kv-int8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conformance_kit_int8_cases_pass_on_the_cpu_platform(dtype):
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    cases = _kit_int8_cases(target, target.ops.get("paged_attention"), dtype)
    assert len(cases) == 2
    for _desc, body in cases:
        body()


def test_conformance_kit_int8_cases_catch_an_attention_that_ignores_the_scales():
    from pagedserve.testing.target import select_target

    target = select_target("cpu")

    def unscaled(query, key_cache, value_cache, *rest, **kw):  # reads the values, not values * scale
        d = query.shape[-1]
        k, v = key_cache[..., :d].float(), value_cache[..., :d].float()
        return reference.paged_attention(query, k, v, *rest, **kw)

    for _desc, body in _kit_int8_cases(target, unscaled, torch.float32):
        with pytest.raises(AssertionError, match="paged_attention over a KV cache of int8"):
            body()
