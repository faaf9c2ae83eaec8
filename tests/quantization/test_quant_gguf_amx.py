"""The GGUF linear on AMX int8 tiles (kernels/cpu/quant_gguf_amx.cpp): built only where
the CPU has AMX int8 (never attempted elsewhere), it agrees with the reference to the
int8 activation error, returns the tiled VNNI kernel's result bit for bit on the same
packed weight, each row's result is independent of the other rows, and the CPU platform
sends it only repacked weights at ``GGUF_AMX_MIN_ROWS`` rows or more when switched on."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native
from test_quant_kernels import ACT_Q_TOL, TOL, random_gguf, rel_err

from pagedserve.kernels import build, reference
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu import quant_gguf_amx
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import CpuOptions

TYPES = ("Q4_0", "Q4_1", "Q8_0")
#: (N, K): the default model's qkv, gate/up and down shapes, and odd ones (5 and 3 column
#: groups: a lone last group; 3 and 5 blocks).
SHAPES = ((960, 576), (3072, 576), (576, 1536), (80, 160), (48, 96))
ROWS = (1, 2, 15, 16, 17, 31, 33, 100, 257, 600)

_REASON = quant_gguf_amx.amx_int8_unavailable_reason()
needs_amx = pytest.mark.skipif(_REASON is not None, reason=f"no AMX int8 GGUF kernel here: {_REASON}")


def _amx():
    # The CPU has AMX int8: a kernel that did not build fails (tests/native_build.py).
    return require_native(quant_gguf_amx.load_gguf_amx, quant_gguf_amx.gguf_amx_build_spec, "AMX int8 GGUF kernel")


def _packed(type_name: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    data = random_gguf(type_name, n, k, gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    assert packed.dim() == 3, "the VNNI tiled kernel's packing is unavailable"
    return data, packed


def test_build_is_gated_on_the_cpu_flags(monkeypatch):
    """Without AMX int8 nothing is built: the reason names the missing flags and the
    loader returns None without calling the build."""
    assert "amx_int8" in quant_gguf_amx.amx_int8_unavailable_reason(frozenset({"amx_tile", "avx512bw"}))
    full = frozenset(quant_gguf_amx.AMX_INT8_FEATURES)
    assert quant_gguf_amx.amx_int8_unavailable_reason(full, ["-mavx512bw"]) is not None
    assert quant_gguf_amx.amx_int8_unavailable_reason(full, ["-mavx512bw", "-mavx512bf16"]) is None

    def no_build(*args, **kwargs):
        raise AssertionError("build attempted on a CPU without AMX int8")

    monkeypatch.setattr(build, "read_cpu_features", lambda: frozenset({"avx512bw", "avx512_bf16"}))
    monkeypatch.setattr(build, "load_extension", no_build)
    quant_gguf_amx.load_gguf_amx.cache_clear()
    try:
        assert quant_gguf_amx.load_gguf_amx() is None
    finally:
        quant_gguf_amx.load_gguf_amx.cache_clear()


@needs_amx
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_reference_and_vnni_kernel(type_name, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    data, packed = _packed(type_name, n, k, gen)
    amx, vnni, tid = _amx(), load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    for m in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen) if m % 2 else None
            # The kernel allocates y itself: a NaN tensor of its size freed just before makes
            # it likely that memory it reuses holds NaN, so an unwritten row or column fails.
            del_me = torch.full((m, n), float("nan"), dtype=dtype)
            del del_me
            y = amx.gguf_linear_out(x, packed, tid, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            assert torch.isfinite(y).all(), (m, dtype)
            expect = reference.gguf_linear(x, data, type_name, bias)
            assert rel_err(y, expect) < ACT_Q_TOL + TOL[dtype], (m, dtype)
            assert torch.equal(y, vnni.gguf_linear_out(x, packed, tid, bias)), (m, dtype)


@needs_amx
@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_batch_invariant(type_name):
    """Row tiles of 16 and 32 rows, zero padding: a row's result is bit for bit the same
    alone, in a partial tile or among 300 rows."""
    gen = torch.Generator().manual_seed(21)
    _, packed = _packed(type_name, 80, 160, gen)
    x = torch.randn(300, 160, generator=gen).to(torch.bfloat16)
    amx, tid = _amx(), ref.GGUF_TYPE_IDS[type_name]
    full = amx.gguf_linear_out(x, packed, tid, None)
    for i in (0, 15, 16, 150, 299):
        for count in (1, 3, 16, 17, 33):
            part = x[i : i + count]
            assert torch.equal(amx.gguf_linear_out(part, packed, tid, None), full[i : i + count]), (i, count)


@needs_amx
def test_platform_dispatch_by_rows():
    """Switched on, the registered gguf_linear and gated op run AMX from
    GGUF_AMX_MIN_ROWS rows, with the same results as the VNNI kernel on both sides."""
    ops = OpRegistry()
    cpu_quant.register_cpu_quant_ops(ops, CpuOptions(gguf_amx=True))
    assert ops.source("gguf_linear").endswith("+amx-int8")
    gen = torch.Generator().manual_seed(5)
    data, packed = _packed("Q4_1", 64, 96, gen)
    vnni, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS["Q4_1"]
    for m in (1, cpu_quant.GGUF_AMX_MIN_ROWS - 1, cpu_quant.GGUF_AMX_MIN_ROWS, 300):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        assert torch.equal(ops.gguf_linear(x, packed, "Q4_1"), vnni.gguf_linear_out(x, packed, tid, None))
        gated = ops.gguf_linear_silu_and_mul(x, packed, "Q4_1")
        assert torch.equal(gated, vnni.gguf_linear_silu_out(x, packed, tid, None)), m
    off = OpRegistry()
    cpu_quant.register_cpu_quant_ops(off, CpuOptions())
    assert "amx" not in off.source("gguf_linear")
