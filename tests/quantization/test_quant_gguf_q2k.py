"""Q2_K kept in its blocks (an optional type: the CPU declares ``gguf_type:Q2_K``).

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer (gguf_blocks.py) writes blocks ``gguf.quants``
  reads back within the format's rounding.
- The CPU row kernel (the file's blocks: rows not a multiple of 16) and the tiled kernel
  (repacked at load) against the int8-activation product computed in float64 (float32
  summation order only) and the float reference (the ``gguf_linear`` allowance), outputs
  poisoned (NaN) first; each row's result alone the same as among others; repacking
  lossless; embedding rows from the repacked form; the conformance cases.
- A tiny Llama GGUF with Q2_K projections (fused beside Q8_0 / Q4_K parts and alone)
  loads kept and gives the dequantized model's logprobs within the int8-activation error,
  and exactly those with the float reference multiplying the kept blocks.
- The Triton kernel takes Q2_K (under the interpreter; no GPU platform declares it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import quantize, run_triton_interpreted, write_tiny_llama_gguf
from test_quant_gguf_kquants import (
    check_kept_against_dequantized,
    int8_activation_reference,
    nan_outputs,
    native,
)

from pagedserve.kernels import quant_reference as ref
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, gguf_kept_types

T = "Q2_K"
TID = ref.GGUF_TYPE_IDS[T]


def random_q2k(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 84]: random quants and 4-bit scales / minimums, realistic fp16 d, dmin."""
    raw = torch.randint(0, 256, (n, k // 256, 84), dtype=torch.uint8, generator=gen)
    for at in (80, 82):
        scale = (torch.rand(n, k // 256, generator=gen) * 0.02 + 1e-3) / 8
        raw[..., at : at + 2] = scale.half().view(torch.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def test_reference_dequantizer_matches_gguf_quants():
    import gguf

    gen = torch.Generator().manual_seed(1)
    raw = random_q2k(6, 512, gen)
    # Fields of any sign and size too (only NaN/inf fp16 values are left out).
    mixed = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
    for data in (raw, mixed):
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q2_K)
        got = ref.dequantize_gguf(data, T)
        finite = np.isfinite(want)
        assert got.shape == want.shape and finite.mean() > 0.5
        np.testing.assert_array_equal(got.numpy()[finite], want[finite])
    assert ref.gguf_row_bytes(T, 512) == 168 and ref.GGUF_BLOCK_VALUES[T] == 256


def test_test_quantizer_blocks_read_back_with_gguf():
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 768)) * 0.1).astype(np.float32)
    x[1] += 0.2  # an offset row: the minimums matter
    raw = quantize(x, T)
    assert raw.shape == (5, 3 * 84) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q2_K)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.35  # 2 bits: 26% measured
    assert np.array_equal(ref.dequantize_gguf(torch.from_numpy(raw), T).numpy(), back)


def _check_against_references(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    exact = int8_activation_reference(x, raw, T)
    assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item()
    want = x.float() @ ref.dequantize_gguf(raw, T).t()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2.5e-2, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    """The file's blocks (what rows not a multiple of 16 keep): 40 and 24 rows, the
    default model's K 1536 and 256."""
    module = native()
    gen = torch.Generator().manual_seed(3)
    for k in (256, 1536):
        for m in (1, 3, 17, 64):
            n = 40 if m != 17 else 24
            raw = random_q2k(n, k, gen)
            assert cpu_quant.prepare_gguf_weight(raw, T) is raw
            x = torch.randn(m, k, generator=gen).to(dtype)
            with nan_outputs():
                got = module.gguf_linear(x, raw, TID)
            _check_against_references(got, x, raw)
            bias = torch.randn(n, generator=gen)
            y = cpu_quant.gguf_linear(x, raw, T, bias)
            assert y.dtype == dtype
            torch.testing.assert_close(y.float(), (got + bias).to(dtype).float(), rtol=0, atol=0)
    raw = random_q2k(24, 512, gen)
    x = torch.randn(9, 512, generator=gen)
    whole = module.gguf_linear(x, raw, TID)
    for i in (0, 4, 8):
        assert torch.equal(module.gguf_linear(x[i : i + 1], raw, TID)[0], whole[i])
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.gguf_linear(torch.randn(1, 224), raw[:, :84], TID)
    with pytest.raises(RuntimeError, match="bytes"):
        module.gguf_linear(torch.randn(1, 256), raw[:, :80], TID)


def _tiled_module():
    module = native()
    if not (module.has_packed() and module.has_kpacked(TID)):
        pytest.skip("no AVX-512 VNNI tiled Q2_K kernel here")
    return module


def test_repacking_is_lossless():
    module = _tiled_module()
    gen = torch.Generator().manual_seed(10)
    # Every byte random (any scale, any bit pattern).
    noise = torch.randint(0, 256, (48, 3 * 84), dtype=torch.uint8, generator=gen)
    packed = cpu_quant.prepare_gguf_weight(noise, T)
    assert packed.shape == (3, 3, 16 * 84) and packed.dtype == torch.uint8
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, T), noise)
    ids = torch.tensor([47, 0, 16, 16, 5, 31])
    assert torch.equal(module.unpack_rows(packed, TID, ids), noise[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        module.unpack_rows(packed, TID, torch.tensor([48]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference(dtype):
    """80 columns (5 groups: a partial column tile) and 32; K 256 and 1536; row counts
    over partial row tiles.  The tiled kernel equals the int8-activation product to
    float32 summation order, the row kernel to float32 rounding, every output written,
    each row alone bit for bit the same as among others; bias and x's dtype out."""
    module = _tiled_module()
    gen = torch.Generator().manual_seed(11)
    for n, k in ((80, 256), (32, 1536)):
        raw = random_q2k(n, k, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, T)
        assert packed.dim() == 3 and packed.nbytes == raw.nbytes
        for m in (1, 3, 4, 5, 7, 17, 64):
            x = torch.randn(m, k, generator=gen).to(dtype)
            with nan_outputs():
                tiled = module.gguf_linear(x, packed, TID)
            _check_against_references(tiled, x, raw)
            rows = module.gguf_linear(x, raw, TID)
            assert ((tiled - rows).abs().max() / rows.abs().max()).item() < 1e-5
            for i in {0, m // 2, m - 1}:
                assert torch.equal(module.gguf_linear(x[i : i + 1], packed, TID)[0], tiled[i])
            bias = torch.randn(n, generator=gen)
            with nan_outputs():
                out = cpu_quant.gguf_linear(x, packed, T, bias)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), (tiled + bias).to(dtype).float(), rtol=0, atol=0)
            if dtype == torch.bfloat16:  # float32 sums unrounded from bf16 activations
                out32 = cpu_quant.gguf_linear(x, packed, T, bias, torch.float32)
                assert out32.dtype == torch.float32 and torch.equal(out32, tiled + bias)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.gguf_linear(torch.randn(1, 512), packed, TID)


def test_embedding_rows_come_from_the_repacked_weight():
    _tiled_module()
    gen = torch.Generator().manual_seed(12)
    raw = random_q2k(96, 512, gen)
    ids = torch.tensor([95, 0, 17, 17, 40, 3, 95, 64])
    w = GGUFWeight(T, raw, 512, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight, embed_op=cpu_quant.gguf_embedding)
    prepared = w.prepared()
    assert prepared.data is None and prepared.packed.dim() == 3 and prepared.embeds_prepared
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize_gguf(raw, T)[ids].to(dtype)
        assert torch.equal(prepared.embedding(ids, dtype), want)


def test_cpu_declares_q2k_and_passes_the_conformance_cases():
    from pagedserve.platforms.ops import GGUF_EXTENDED, OpRegistry
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    native()
    target = select_target("cpu")
    assert target.ops.has_capability("gguf_linear", ref.gguf_type_capability(T))
    assert T in gguf_kept_types(target.ops)
    # Without the capability the type is dequantized at load, even beside the extended ones.
    plain = OpRegistry()
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    assert T not in gguf_kept_types(plain)
    checks = [
        c
        for c in op_checks(target)
        if f"-{T}-" in c.id and c.id.split("[")[0] in ("op:gguf_linear", "op:prepare_gguf_weight", "op:gguf_embedding")
    ]
    # At least float32 and bfloat16 x 5 shapes of gguf_linear, plus 2 dtypes x 2 embedding
    # sizes (prepare_gguf_weight's cases too where the build repacks for its tiled kernel).
    assert len(checks) >= 2 * 5 + 4, [c.id for c in checks]
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


# --- a tiny llama GGUF with Q2_K projections ----------------------------------------------

_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: Layer 0: Q2_K beside Q8_0 (qkv) and Q4_K (gate/up); layer 1: all Q2_K.
LAYER_TYPES = (
    dict(zip(_PARTS, ("Q2_K", "Q2_K", "Q8_0", "Q2_K", "Q2_K", "Q4_K", "Q2_K"))),
    dict(zip(_PARTS, ("Q2_K",) * 7)),
)
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2


def write_q2k_gguf(path, seed: int = 0):
    """A 2-layer Llama GGUF (hidden 256) with LAYER_TYPES, a tied Q2_K embedding (261
    rows: not a multiple of 16, so the row kernel's) and the byte-level test tokenizer."""
    return write_tiny_llama_gguf(
        path,
        LAYER_TYPES,
        T,
        hidden=HIDDEN,
        inter=INTER,
        heads=HEADS,
        kv_heads=KV_HEADS,
        name="tiny q2_k llama",
        seed=seed,
    )


def test_q2k_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        # Q2_K parts stay Q2_K: beside Q8_0 / Q4_K as runs of one type, alone fused whole.
        assert isinstance(layer0.qkv, StackedWeight) and [p.type_name for p in layer0.qkv.parts] == [T, "Q8_0"]
        assert [p.type_name for p in layer0.gate_up.parts] == [T, "Q4_K"]
        for w in (layer0.o, layer0.down, layer1.qkv, layer1.o, layer1.gate_up, layer1.down, model.lm_head):
            assert isinstance(w, GGUFWeight) and w.type_name == T
        assert layer1.gate_up.out_features == 2 * INTER
        if module.has_kpacked(TID):  # repacked at load where the tiled kernel is built
            assert layer1.down.packed is not None and layer1.down.packed.dim() == 3

    check_kept_against_dequantized(write_q2k_gguf(tmp_path / "q2k.gguf"), check)


TRITON_SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(1)
def rel_err(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()
for m, n in ((1, 24), (3, 40)):
    raw = torch.randint(0, 256, (n, 2, 84), dtype=torch.uint8, generator=gen)
    for at in (80, 82):  # realistic fp16 d, dmin; the rest random
        scale = (torch.rand(n, 2, generator=gen) * 0.003 + 1e-4).half()
        raw[..., at : at + 2] = scale.view(torch.uint8).reshape(n, 2, 2)
    raw = raw.reshape(n, -1)
    x = torch.randn(m, 512, generator=gen)
    b = torch.randn(n, generator=gen)
    out = gguf_linear_triton(x.to(dev), raw.to(dev), "Q2_K", b.to(dev)).cpu()
    err = rel_err(out, ref.gguf_linear(x, raw, "Q2_K", b))
    assert err < 1e-5, (m, n, err)
print("ok")
"""


def test_triton_kernel_takes_q2k_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(TRITON_SCRIPT)
