"""Every quantized matmul against its dequantize-then-matmul reference, on fresh random
inputs, with dtype-keyed tolerances (relative Frobenius error of the output)."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native
from test_quant_support import awq_quantize, gptq_quantize

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels, quant_build_spec
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.fp8 import Fp8Weight, quantize_fp8
from pagedserve.quantization.gguf import GGUF_TYPE_IDS, GGUFWeight
from pagedserve.quantization.int4 import AWQWeight, GPTQWeight
from pagedserve.quantization.int8 import Int8Weight, W8A8Weight, quantize_int8_per_channel

# Output dtype rounding plus, for kernels that quantize activations (GGUF int8 dot
# products, W8A8), the int8 activation error (~1/127 of a block's max per value).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ACT_Q_TOL = 2.5e-2


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def random_gguf(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/32 * block_bytes]: random quants with realistic fp16 scales/minimums."""
    bb, nb = ref.GGUF_BLOCK_BYTES[type_name], k // 32
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=gen)
    raw[..., 0:2] = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).reshape(n, nb, 2)
    if type_name in ("Q4_1", "Q5_1"):  # the minimum
        raw[..., 2:4] = (torch.randn(n, nb, generator=gen) * 0.05).half().view(torch.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def test_quant_gguf_reference_matches_loader_dequant():
    """The torch reference decodes blocks exactly as the loader's numpy dequantizer."""
    from pagedserve.loader.dequant import dequantize

    gen = torch.Generator().manual_seed(1)
    for t in ("Q4_0", "Q4_1", "Q8_0"):
        raw = random_gguf(t, 8, 64, gen)
        expect = torch.from_numpy(dequantize(raw.numpy(), t, (8, 64)))
        assert torch.equal(ref.dequantize_gguf(raw, t), expect), t


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_gguf_cpu_kernel(type_name, m, dtype):
    require_native(load_quant_kernels, quant_build_spec, "the quantized CPU kernels")
    gen = torch.Generator().manual_seed(m)
    raw = random_gguf(type_name, 72, 160, gen)
    x = torch.randn(m, 160, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen)
    w = GGUFWeight(type_name, raw, 160, op=cpu_quant.gguf_linear)
    out = w.apply(x, bias)
    assert out.dtype == dtype and out.shape == (m, 72)
    expect = ref.gguf_linear(x, raw, type_name, bias)
    assert rel_err(out, expect) < ACT_Q_TOL + TOL[dtype]
    # The kernel itself (before bias/cast): int8 activations are its only approximation.
    y = load_quant_kernels().gguf_linear(x, raw, GGUF_TYPE_IDS[type_name])
    assert rel_err(y, ref.gguf_linear(x.float(), raw, type_name)) < ACT_Q_TOL


def test_quant_gguf_dense_path_and_concat(monkeypatch):
    monkeypatch.setattr(cpu_quant, "CPU_DENSE_MIN_ROWS", 128)  # the opt-in dense prefill path
    gen = torch.Generator().manual_seed(3)
    parts = [GGUFWeight("Q4_1", random_gguf("Q4_1", 16, 64, gen), 64, op=cpu_quant.gguf_linear) for _ in range(2)]
    fused = GGUFWeight.concat(parts)
    assert fused.shape == (32, 64) and fused.nbytes == 32 * 2 * 20 and fused.op is cpu_quant.gguf_linear
    x = torch.randn(200, 64, generator=gen)  # past CPU_DENSE_MIN_ROWS: dequantize + dense matmul
    assert x.shape[0] >= cpu_quant.CPU_DENSE_MIN_ROWS
    expect = torch.cat([ref.gguf_linear(x, p.data, "Q4_1") for p in parts], dim=1)
    assert rel_err(fused.apply(x), expect) < TOL[torch.float32]
    mixed = GGUFWeight.concat([parts[0], GGUFWeight("Q8_0", random_gguf("Q8_0", 8, 64, gen), 64)])
    assert mixed.apply(x[:3]).shape == (3, 24)
    ids = torch.tensor([3, 0, 15])
    assert torch.equal(parts[0].embedding(ids, torch.float32), parts[0].dequantize()[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_quant_int8_weight_only(dtype, m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(48, 96, generator=gen)
    q, s = quantize_int8_per_channel(w)
    assert (w - q.float() * s[:, None]).abs().max() <= s.max() / 2 + 1e-6
    x = torch.randn(m, 96, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen)
    out = Int8Weight(q, s, op=cpu_quant.int8_linear).apply(x, bias)  # torch._weight_int8pack_mm
    assert out.dtype == dtype
    assert rel_err(out, ref.int8_linear(x, q, s, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_quant_w8a8(dtype, m):
    gen = torch.Generator().manual_seed(10 + m)
    q, s = quantize_int8_per_channel(torch.randn(40, 64, generator=gen))
    x = torch.randn(m, 64, generator=gen).to(dtype)
    out = W8A8Weight(q, s, op=cpu_quant.w8a8_linear).apply(x)  # torch._int_mm
    # Integer products are exact, so only the output rounding separates it from the reference.
    assert rel_err(out, ref.w8a8_linear(x, q, s)) < TOL[dtype]
    # And the whole scheme stays close to the float matmul.
    assert rel_err(out, x.float() @ (q.float() * s[:, None]).t()) < ACT_Q_TOL


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_fp8(per_channel, dtype):
    gen = torch.Generator().manual_seed(int(per_channel))
    w = torch.randn(32, 64, generator=gen)
    q, s = quantize_fp8(w, per_channel)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ((32,) if per_channel else ())
    x = torch.randn(5, 64, generator=gen).to(dtype)
    out = Fp8Weight(q, s, op=ref.fp8_linear_dense).apply(x)  # emulated in x.dtype
    assert rel_err(out, ref.fp8_linear(x, q, s)) < TOL[dtype] * 2
    # e4m3 keeps 3 mantissa bits: ~3% per weight, much less after summation.
    assert rel_err(Fp8Weight(q, s).dequantize(), w) < 0.05
    fused = Fp8Weight.concat([Fp8Weight(q, s), Fp8Weight(*quantize_fp8(w * 3, per_channel))])
    assert fused.shape == (64, 64) and rel_err(fused.dequantize()[32:], w * 3) < 0.05


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_gptq(act_order, dtype):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 128, generator=gen) * 0.1
    t, deq = gptq_quantize(w, 32, act_order, gen)
    weight = GPTQWeight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
    # The packed checkpoint decodes to exactly what the independent quantizer meant.
    assert torch.equal(weight.dequantize(), deq)
    assert rel_err(deq, w) < 0.15
    x = torch.randn(6, 128, generator=gen).to(dtype)
    expect = ref.gptq_linear(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
    assert rel_err(weight.apply(x), expect) < TOL[dtype]
    assert rel_err(expect, x.float() @ deq.t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_awq(dtype):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(1040, 64, generator=gen) * 0.1  # > TILE_N outputs: several tiles
    t, deq = awq_quantize(w, 32)
    weight = AWQWeight(t["qweight"], t["qzeros"], t["scales"], 32)
    assert torch.equal(weight.dequantize(), deq)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    expect = ref.awq_linear(x, t["qweight"], t["qzeros"], t["scales"], 32)
    assert rel_err(weight.apply(x), expect) < TOL[dtype]
    fused = AWQWeight.concat([weight, weight])
    assert torch.equal(fused.dequantize(), torch.cat([deq, deq]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quant_gguf_rows_are_batch_invariant(type_name, dtype):
    """Each row of the CPU gguf_linear is bit for bit the same alone or among 300 rows (a
    prefill): the default model's greedy output must not depend on its batch."""
    gen = torch.Generator().manual_seed(11)
    data = random_gguf(type_name, 40, 128, gen)
    x = torch.randn(300, 128, generator=gen).to(dtype)
    full = cpu_quant.gguf_linear(x, data, type_name)
    for i in (0, 7, 150, 299):
        assert torch.equal(cpu_quant.gguf_linear(x[i : i + 1], data, type_name)[0], full[i]), i
        assert torch.equal(cpu_quant.gguf_linear(x[i : i + 9], data, type_name)[0], full[i]), i
