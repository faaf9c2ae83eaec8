"""The CPU's tiled int8 GEMM on repacked GGUF blocks (kernels/cpu/quant_gguf_packed.cpp):
the repacking is lossless, the CPU conformance cases of ``gguf_linear`` and
``prepare_gguf_weight`` pass, the tiled kernel agrees with the row kernel to float32
rounding, each row's result is bit for bit independent of the other rows, and the model's
linear weights take the packed form once at load (a tied embedding and LM head share
the packed weight, rows read from it)."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import random_gguf

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight
from pagedserve.testing.op_suite import op_checks
from pagedserve.testing.target import select_target

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")


def _packed_kernel_available() -> bool:
    module = load_quant_kernels()
    return module is not None and module.has_packed()


needs_packed = pytest.mark.skipif(not _packed_kernel_available(), reason="no AVX-512 VNNI tiled GGUF kernel here")


@needs_packed
@pytest.mark.parametrize("type_name", TYPES)
def test_repacking_is_lossless(type_name):
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64, 5 * ref.GGUF_BLOCK_BYTES[type_name]), dtype=torch.uint8, generator=gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    assert packed.shape == (4, 5, 16 * ref.GGUF_BLOCK_BYTES[type_name]) and packed.dtype == torch.uint8
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, type_name), data)


def test_weights_the_tiled_kernel_cannot_take_stay_blocks():
    gen = torch.Generator().manual_seed(4)
    data = random_gguf("Q4_1", 40, 64, gen)  # 40 rows: not a multiple of 16
    assert cpu_quant.prepare_gguf_weight(data, "Q4_1") is data
    assert cpu_quant.prepare_gguf_weight(data[:0], "Q4_1").shape[0] == 0


@pytest.mark.parametrize("op", ["gguf_linear", "prepare_gguf_weight", "gguf_embedding"])
def test_cpu_conformance_cases(op):
    """The kit's cases (rows 1..300, outputs that are and are not multiples of 16,
    with and without bias, float32 and bfloat16) for the CPU's own ops."""
    target = select_target("cpu")
    if op not in target.overridden_ops():
        pytest.skip(f"the CPU platform keeps the reference {op} here")
    checks = [c for c in op_checks(target) if c.id.startswith(f"op:{op}[")]
    assert len(checks) >= 2 * 3 * 7  # dtypes x types x shapes
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_tiled_matches_row_kernel_and_is_batch_invariant(type_name, dtype):
    """Same int8 activations, integer dot products and block scale math as the row
    kernel: only the float32 summation order differs.  Every row is bit for bit the same
    alone, in a partial row tile or among 300 rows (rows split into tiles of different
    heights; Q5_x's fifth bits unpack one way in short tiles and another in tall ones)."""
    gen = torch.Generator().manual_seed(12)
    k, n = 160, 80  # 5 blocks; 5 column groups: full and partial column tiles
    data = random_gguf(type_name, n, k, gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    x = torch.randn(300, k, generator=gen).to(dtype)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    full = module.gguf_linear(x, packed, tid)
    rows = module.gguf_linear(x, data, tid)
    assert ((full - rows).abs().max() / rows.abs().max()).item() < 1e-5
    for i in (0, 5, 150, 299):
        for count in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16):
            part = x[i : i + count]
            assert torch.equal(module.gguf_linear(part, packed, tid)[0], full[i]), (i, count)


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_fused_output_equals_float32_plus_bias_rounded(type_name, dtype):
    """gguf_linear_out (bias added and the result rounded to x's dtype inside the
    kernel) gives exactly what the float32 kernel output + bias, then .to(dtype), gives,
    on packed weights and on the file's blocks; rows 1..300 over odd tile remainders."""
    gen = torch.Generator().manual_seed(21)
    k, n = 96, 112  # 7 column groups: whole and narrower column tiles
    data = random_gguf(type_name, n, k, gen)
    packed = cpu_quant.prepare_gguf_weight(data, type_name)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    bias = torch.randn(n, generator=gen).to(dtype)
    for m in (1, 2, 5, 7, 13, 241, 300):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for w in (packed, data):
            want = (module.gguf_linear(x, w, tid) + bias.float()).to(dtype)
            got = module.gguf_linear_out(x, w, tid, bias)
            assert got.dtype == dtype and torch.equal(got, want), (m, w.dim())
            plain = module.gguf_linear_out(x, w, tid)
            assert torch.equal(plain, module.gguf_linear(x, w, tid).to(dtype)), (m, w.dim())
    with pytest.raises(RuntimeError, match="bias"):
        module.gguf_linear_out(x, packed, tid, torch.zeros(n + 1))


@needs_packed
def test_dense_fallback_reads_packed_weights(monkeypatch):
    monkeypatch.setattr(cpu_quant, "CPU_DENSE_MIN_ROWS", 128)
    gen = torch.Generator().manual_seed(5)
    data = random_gguf("Q4_0", 32, 64, gen)
    x = torch.randn(200, 64, generator=gen)
    got = cpu_quant.gguf_linear(x, cpu_quant.prepare_gguf_weight(data, "Q4_0"), "Q4_0")
    assert torch.equal(got, cpu_quant.gguf_linear(x, data, "Q4_0"))


@needs_packed
def test_weights_are_prepared_after_fusion():
    gen = torch.Generator().manual_seed(6)
    op, prepare = cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight
    parts = [GGUFWeight("Q4_1", random_gguf("Q4_1", 32, 64, gen), 64, op, prepare) for _ in range(2)]
    fused = GGUFWeight.concat(parts)
    assert fused.packed is None
    prepared = fused.prepared()
    assert prepared.packed is not None and prepared.prepared() is prepared
    assert prepared.data is None and prepared.shape == fused.shape and prepared.nbytes == fused.nbytes
    assert prepared.to(torch.device("cpu")) is prepared
    with pytest.raises(ValueError, match="repacked at load"):
        prepared.dequantize()
    with pytest.raises(ValueError, match="repacked at load"):
        GGUFWeight.concat([prepared, prepared])
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(prepared.apply(x), op(x, prepared.packed, "Q4_1"))
    assert ((prepared.apply(x) - fused.apply(x)).abs().max() / fused.apply(x).abs().max()).item() < 1e-5
    mixed = StackedWeight([parts[0], GGUFWeight("Q8_0", random_gguf("Q8_0", 16, 64, gen), 64, op, prepare)])
    assert all(p.packed is not None for p in mixed.prepared().parts)
    plain = GGUFWeight("Q4_1", parts[0].data, 64, op)  # no prepare op: the blocks as they are
    assert plain.prepared() is plain


@needs_packed
def test_default_model_linears_are_repacked_at_load():
    from pagedserve import LLM

    llm = LLM(kv_cache_memory="16MiB", max_model_len=256)
    model = llm.llm_engine.runner.model
    layer = model.layers[0]
    for name in model.linear_fields:
        w = getattr(layer, name)
        assert isinstance(w, GGUFWeight) and w.data is None and w.packed.dim() == 3, name
    # Tied: embedding and LM head are one prepared weight (rows read from the packed form).
    assert model.embed is model.lm_head and model.lm_head.packed is not None
    ids = torch.tensor([0, 1, 17, 49151])
    tokens = model.embed_tokens(ids)
    blocks = cpu_quant.unpack_gguf_weight(model.lm_head.packed, model.lm_head.type_name)
    assert torch.equal(tokens, ref.dequantize_gguf(blocks[ids], model.lm_head.type_name).to(tokens.dtype))
    llm.shutdown()
