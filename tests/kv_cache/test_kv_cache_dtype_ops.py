"""8-bit float KV caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2) at the op level.

Here: kernels/reference.py's ``quantize_kv`` (saturation, rounding, NaN), the platform
capability and the refusal of a platform without it, and the native kernel's exact
conversion of every byte for float32 queries.  The write, every CPU attention
implementation, dequantized blocks and block copies on unscaled fp8 caches (beside the
other 8-bit kinds) are in test_kv_cache_8bit_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model_runner import check_cache_dtype, kv_cache_torch_dtype
from pagedserve.kernels import reference
from pagedserve.kv_cache.kv_dtype import QUANTIZED_KV_DTYPES
from pagedserve.platforms.cpu.platform import CpuPlatform
from tests.kv_cache.kv8_inputs import gen_for

pytestmark = pytest.mark.timeout(600)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]

# ---- the format ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_quantize_kv_saturates_rounds_and_keeps_nan(kv_dtype):
    big = torch.finfo(kv_dtype).max
    x = torch.randn(4096, generator=gen_for(kv_dtype)) * 20
    x[:4] = torch.tensor([1e9, -1e9, big * 1.5, float("nan")])
    got = reference.quantize_kv(x, kv_dtype)
    assert got.dtype == kv_dtype
    g = got.float()
    assert g[0] == big and g[1] == -big and g[2] == big and g[3].isnan()
    assert not g.isinf().any()
    # Round to nearest: no representable value lies strictly closer than the stored one.
    table = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    table = table[table.isfinite()]
    finite = x[4:]
    nearest = (finite.view(-1, 1) - table.view(1, -1)).abs().min(dim=1).values
    assert torch.equal((finite - g[4:]).abs(), nearest)


# ---- the platform capability ----------------------------------------------------------


def test_cpu_platform_declares_both_fp8_formats():
    assert set(CpuPlatform.kv_cache_dtypes) == set(QUANTIZED_KV_DTYPES)
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    assert kv_cache_torch_dtype("auto", torch.float32) is torch.float32


def test_a_platform_without_the_capability_is_refused_by_name():
    from pagedserve.platforms.interface import Platform

    class Bare(Platform):
        name = "bare"

    class Int8Only(Platform):
        name = "int8-only"
        kv_cache_dtypes = ("int8",)

    for cls in (Bare, Int8Only):
        msg = rf"kv_cache_dtype='fp8' is not supported on platform '{cls.name}'.*fp8_e4m3"
        with pytest.raises(ValueError, match=msg):
            check_cache_dtype("fp8", torch.bfloat16, [cls])
    check_cache_dtype("fp8_e5m2", torch.bfloat16, [CpuPlatform])
    with pytest.raises(ValueError, match="differs from the model's dtype"):
        check_cache_dtype("float16", torch.bfloat16, [CpuPlatform])


# ---- the native kernel's in-register conversion ---------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_native_kv8_conversion_is_exact_for_every_byte(every_isa, kv_dtype):
    """One key per sequence: the output is its value row times probability 1, so each of
    the 256 byte patterns (NaN included) must come out as its exact float32 value."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype).view(1, 1, 4, 64)
    key = torch.zeros(1, 1, 4, 64, dtype=torch.uint8).view(kv_dtype)
    query = torch.randn(1, 4, 64, generator=gen_for("bytes", kv_dtype))
    args = (query, key, values, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
    want = values.float().view(1, 4, 64)
    for isa, kernels in every_isa.items():
        out = torch.full_like(query, 7.0)
        kernels.paged_attention(*args, 0.125, out)
        assert torch.equal(out.isnan(), want.isnan()), isa
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), isa
