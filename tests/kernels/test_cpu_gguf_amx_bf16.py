"""The GGUF linear on AMX-BF16 tiles (kernels/cpu/quant_gguf_amx.cpp, ``bf16tiles``): the
packed Q4_0/Q4_1/Q8_0 weight dequantized per column pair and multiplied in bf16 agrees
with kernels/reference.py on random inputs and odd shapes (every output written), each
row's result depends on that row alone, and the gated variant writes what
``silu_and_mul`` writes after it.  Built and run only where the CPU has AMX."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels, quant_gguf_amx
from pagedserve.platforms.cpu import quant_ops as cpu_quant

TYPES = ("Q4_0", "Q4_1", "Q8_0")
#: (N, K): the default model's qkv and down shapes, and odd ones (5 and 3 column groups:
#: a lone last group; 5 and 3 blocks).
SHAPES = ((960, 576), (576, 1536), (80, 160), (48, 96))
ROWS = (1, 15, 16, 17, 33, 100, 257)
#: x and the weight rounded to bf16, float32 sums: ~0.3% of the float result (bf16
#: outputs add their own rounding); the int8 VNNI kernel's error is about twice that.
TOL = {torch.float32: 6e-3, torch.bfloat16: 1.2e-2}

_REASON = quant_gguf_amx.amx_int8_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no AMX GGUF kernels here: {_REASON}")


def _amx():
    return require_native(quant_gguf_amx.load_gguf_amx, quant_gguf_amx.gguf_amx_build_spec, "AMX GGUF kernels")


def random_gguf(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/32 * block_bytes]: random quants, realistic fp16 scales and minimums."""
    bb, nb = ref.GGUF_BLOCK_BYTES[type_name], k // 32
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=gen)
    raw[..., 0:2] = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).reshape(n, nb, 2)
    if type_name == "Q4_1":
        raw[..., 2:4] = (torch.randn(n, nb, generator=gen) * 0.05).half().view(torch.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def _packed(type_name: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    data = random_gguf(type_name, n, k, gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    assert packed.dim() == 3, "the tiled kernels' packing is unavailable"
    return data, packed


def _poison(m: int, n: int, dtype: torch.dtype) -> None:
    # The kernel allocates y itself: a NaN tensor of its size freed just before makes it
    # likely that the memory it reuses holds NaN, so an unwritten row or column fails.
    poison = torch.full((m, n), float("nan"), dtype=dtype)
    del poison


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_reference(type_name, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    data, packed = _packed(type_name, n, k, gen)
    amx, tid = _amx(), ref.GGUF_TYPE_IDS[type_name]
    for m in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
            bias = torch.randn(n, generator=gen) if m % 2 else None
            _poison(m, n, dtype)
            y = amx.gguf_bf16_linear_out(x, packed, tid, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            assert torch.isfinite(y).all(), (m, dtype)
            expect = reference.gguf_linear(x, data, type_name, bias)
            assert rel_err(y, expect) < TOL[dtype], (m, dtype, rel_err(y, expect))
            # Per row as well: no row may hide in the norm of the others.
            worst = max(rel_err(y[i], expect[i]) for i in range(m))
            assert worst < 4 * TOL[dtype], (m, dtype, worst)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_independent_of_the_batch(type_name):
    """Row tiles of 16 and 32 rows, zero padding: a row's result is bit for bit the same
    alone, in a partial tile or among 300 rows."""
    gen = torch.Generator().manual_seed(3)
    _, packed = _packed(type_name, 80, 160, gen)
    x = torch.randn(300, 160, generator=gen).to(torch.bfloat16)
    amx, tid = _amx(), ref.GGUF_TYPE_IDS[type_name]
    full = amx.gguf_bf16_linear_out(x, packed, tid, None)
    for i in (0, 15, 16, 150, 299):
        for count in (1, 3, 16, 17, 33):
            part = x[i : i + count]
            assert torch.equal(amx.gguf_bf16_linear_out(part, packed, tid, None), full[i : i + count]), (i, count)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_is_silu_and_mul_of_the_linear(type_name, dtype):
    """[gate; up] of 2 x 96 columns (6 groups: gate group g paired with up group g + 3):
    silu(gate) * up as the main kernels' silu_and_mul computes it on the linear's output,
    and within the reference's tolerance of the float result."""
    gen = torch.Generator().manual_seed(11)
    data, packed = _packed(type_name, 192, 160, gen)
    amx, tid = _amx(), ref.GGUF_TYPE_IDS[type_name]
    kernels = load_cpu_kernels()
    for m in (16, 17, 70):
        x = torch.randn(m, 160, generator=gen).to(dtype)
        bias = torch.randn(192, generator=gen) if m % 2 else None
        _poison(m, 96, dtype)
        got = amx.gguf_bf16_linear_silu_out(x, packed, tid, bias)
        assert got.shape == (m, 96) and got.dtype == dtype and torch.isfinite(got).all()
        y = amx.gguf_bf16_linear_out(x, packed, tid, bias)
        silu = kernels.ops()["silu_and_mul"] if kernels is not None else reference.silu_and_mul
        torch.testing.assert_close(got, silu(y), rtol=0, atol=1e-30)
        expect = reference.gguf_linear_silu_and_mul(x, data, type_name, bias)
        assert rel_err(got, expect) < 2 * TOL[dtype], m


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(1)
    _, packed = _packed("Q4_1", 80, 160, gen)
    amx = _amx()
    with pytest.raises(RuntimeError, match="does not match K"):
        amx.gguf_bf16_linear_out(torch.randn(4, 128), packed, 3, None)
    with pytest.raises(RuntimeError, match="gate and up"):
        amx.gguf_bf16_linear_silu_out(torch.randn(4, 160), packed, 3, None)  # 5 groups
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        amx.gguf_bf16_linear_out(torch.randn(4, 160).half(), packed, 3, None)
    with pytest.raises(RuntimeError, match="unsupported"):
        amx.gguf_bf16_linear_out(torch.randn(4, 160), packed, 6, None)
