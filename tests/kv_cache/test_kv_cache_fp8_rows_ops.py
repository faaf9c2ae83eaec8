"""fp8 KV caches with a scale per token and KV head (kv_cache_scales "row", the default
for kv_cache_dtype fp8_e4m3 / fp8_e5m2) at the op level.

A row is ``head_size`` fp8 values followed by the 4 bytes of a float32 scale
(``absmax / the format's largest finite value``, computed on write;
kernels/reference.py ``quantize_kv_rows``), the layout int8 rows have.  Here: the format
(rows with outliers far beyond e4m3's range keep their precision where scale 1.0
saturates), row sizes and layout detection, the scale modes, and the conformance kit's
cases (they pass on the CPU platform and catch an attention that ignores the scales).
The write, every CPU attention implementation, dequantized blocks and block copies on
fp8 rows (beside the other 8-bit kinds) are in test_kv_cache_8bit_ops.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.executor.model_runner import kv_bytes_per_block, kv_row_size
from pagedserve.kernels import reference
from pagedserve.kv_cache import kv_dtype
from tests.kv_cache.kv8_inputs import gen_for

pytestmark = pytest.mark.timeout(600)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]

# ---- the format -----------------------------------------------------------------------


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
def test_quantize_kv_rows_hold_values_then_their_scale(kv):
    top = torch.finfo(kv).max
    gen = gen_for("format", kv)
    x = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 50
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 5] = 1e5  # one outlier, beyond both formats' range: it sets its row's scale only (below)
    rows = reference.quantize_kv_rows(x, kv)
    assert rows.dtype == kv and rows.shape == (300, 3, 68)
    q, s = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / top)
    # The float32 quotient x / s cast with round to nearest even, within [-top, top].
    want = torch.where(s > 0, x / s, torch.zeros_like(x)).clamp(-top, top).to(kv)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().amax(-1)[s.squeeze(-1) > 0].eq(top).all(), "each row's absmax maps to the top value"
    back = reference.dequantize_kv(rows, 64)
    assert torch.equal(back, q.float() * s)
    mant = 3 if kv == torch.float8_e4m3fn else 2
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert back[1, 1, 5] == pytest.approx(1e5, rel=2.0 ** -(mant + 1))
    # Relative error of each normal value: half an ulp of its mantissa.
    normal = back.abs() >= s * 2.0 ** (-6 if kv == torch.float8_e4m3fn else -14)
    err = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal & (x != 0)]
    assert err.max() <= 2.0 ** -(mant + 1) * (1 + 1e-5)


def test_row_scales_do_not_saturate_where_scale_one_does():
    """The motivation: a key of 5000 is stored as 448 at scale 1.0 (e4m3), within half an
    ulp with its row's scale."""
    x = torch.randn(8, 64, generator=gen_for("sat"))
    x[:, 3] = 5000.0
    unscaled = reference.quantize_kv(x, torch.float8_e4m3fn).float()
    assert unscaled[:, 3].eq(448.0).all()
    scaled = reference.dequantize_kv(reference.quantize_kv_rows(x, torch.float8_e4m3fn), 64)
    assert (scaled[:, 3] - 5000.0).abs().max() <= 5000.0 / 16


def test_row_sizes_and_layout_detection():
    assert kv_dtype.KV_SCALE_BYTES == reference.KV_SCALE_BYTES == 4
    for d in (64, 128):
        for t, name in ((torch.float8_e4m3fn, "float8_e4m3fn"), (torch.float8_e5m2, "float8_e5m2")):
            assert kv_row_size(d, t) == reference.kv_row_size(d, t) == kv_dtype.kv_row_size(d, name) == d + 4
            assert kv_row_size(d, t, False) == reference.kv_row_size(d, t, False) == d
            assert reference.kv_rows_scaled(torch.empty(2, 16, 1, d + 4, dtype=t), d)
            assert not reference.kv_rows_scaled(torch.empty(2, 16, 1, d, dtype=t), d)
        assert kv_row_size(d, torch.int8) == d + 4
        assert kv_row_size(d, torch.bfloat16) == kv_row_size(d, torch.bfloat16, True) == d
    with pytest.raises(ValueError, match="always carries a scale"):
        reference.kv_row_size(64, torch.int8, False)
    with pytest.raises(ValueError, match="head_size \\+ 4 = 68"):
        reference.kv_rows_scaled(torch.empty(2, 16, 1, 64, dtype=torch.int8), 64)
    # Rows with their scales: 2 d / (d + 4) the blocks of a bf16 cache; without: 2x.
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=64)
    bf16 = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn) == bf16 * 68 // 128
    assert kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn, False) == bf16 // 2


def test_resolve_kv_scales_modes():
    scales = {0: (0.5, 0.25)}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        assert kv_dtype.resolve_kv_scales("auto", name, None) == (True, None)
        assert kv_dtype.resolve_kv_scales("auto", name, scales) == (False, scales)
        assert kv_dtype.resolve_kv_scales("row", name, scales) == (True, None)
        assert kv_dtype.resolve_kv_scales("tensor", name, None) == (False, None)
        assert kv_dtype.resolve_kv_scales("tensor", name, scales) == (False, scales)
    assert kv_dtype.resolve_kv_scales("auto", "int8", scales) == (True, None)
    assert kv_dtype.resolve_kv_scales("tensor", "bfloat16", scales) == (False, None)


# ---- the conformance kit's fp8 cases ---------------------------------------------------


def _kit_cases(target, fn, dtype, prefix):
    from pagedserve.testing.op_checks import OP_CASES

    return [(d, b) for d, b in OP_CASES["paged_attention"](target, fn, dtype, 0) if d.startswith(prefix)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conformance_kit_fp8_cases_pass_on_the_cpu_platform(dtype):
    """Both layouts of both fp8 names: rows with scales (-rows-) and unscaled rows."""
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    cases = _kit_cases(target, target.ops.get("paged_attention"), dtype, "kv-fp8")
    assert len(cases) == 8 and sum("-rows-" in d for d, _ in cases) == 4
    for _desc, body in cases:
        body()


def test_conformance_kit_fp8_row_cases_catch_an_attention_that_ignores_the_scales():
    from pagedserve.testing.target import select_target

    target = select_target("cpu")

    def unscaled(query, key_cache, value_cache, *rest, **kw):  # reads the values, not values * scale
        d = query.shape[-1]
        k, v = key_cache[..., :d].float(), value_cache[..., :d].float()
        return reference.paged_attention(query, k, v, *rest, **kw)

    cases = _kit_cases(target, unscaled, torch.float32, "kv-fp8_e4m3-rows")
    assert cases
    for _desc, body in cases:
        with pytest.raises(AssertionError, match="paged_attention over a KV cache of fp8_e4m3 with row scales"):
            body()
