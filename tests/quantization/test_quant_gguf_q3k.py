"""Q3_K kept in its blocks on the CPU (kernels/cpu/quant_gguf_q3k.cpp).

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer's Q3_K blocks read back through ``gguf.quants``.
- The CPU's row kernel (the file's blocks) and tiled kernel (blocks repacked at load)
  against the reference, outputs poisoned (NaN) first: within float32 summation of the
  product with the activations rounded to int8 blocks as the kernels round them, and within
  the int8-activation error (relative 2.5e-2) of the float reference; every row the same
  alone; the repacking lossless (native and torch inverses), embedding rows read from it.
- The CPU declares ``gguf_type:Q3_K`` and a load keeps Q3_K; the kit's conformance cases
  for it; the Triton kernel under the interpreter.
- A tiny random Llama GGUF with Q3_K tensors (alone, fused with Q3_K, beside Q4_K / Q6_K /
  Q8_0 in fused projections, and the tied embedding) loads each kept and gives the
  dequantized model's logprobs within the int8-activation error (exactly with the
  reference op on the kept blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import quantize, run_triton_interpreted, write_tiny_llama_gguf
from test_quant_gguf_kquants import check_kept_against_dequantized, int8_activation_reference, nan_outputs, native

from pagedserve.kernels import quant_reference as ref
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, gguf_kept_types

TID = ref.GGUF_TYPE_IDS["Q3_K"]


def random_q3k(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 110]: random quants and scales, fp16 d of realistic size (a weight
    of up to d * 32 * 4 ~ 0.1)."""
    raw = torch.randint(0, 256, (n, k // 256, 110), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.02 + 1e-3) / 32
    raw[..., 108:110] = d.half().view(torch.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def test_format_constants():
    assert ref.GGUF_BLOCK_BYTES["Q3_K"] == 110 and ref.GGUF_BLOCK_VALUES["Q3_K"] == 256
    assert TID == 11 and "Q3_K" in ref.GGUF_OPTIONAL_TYPES
    assert ref.gguf_type_capability("Q3_K") == "gguf_type:Q3_K"


def test_reference_dequantizer_matches_gguf_quants():
    import gguf

    gen = torch.Generator().manual_seed(1)
    raw = random_q3k(6, 768, gen)
    # d of any sign and size too (NaN/inf fp16 fields left out of the comparison).
    mixed = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
    for data in (raw, mixed):
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q3_K)
        got = ref.dequantize_gguf(data, "Q3_K")
        finite = np.isfinite(want)
        assert got.shape == want.shape == (6, 768) and finite.mean() > 0.5
        np.testing.assert_array_equal(got.numpy()[finite], want[finite])
    # The random blocks exercise (nearly) every 6-bit scale.
    sc = ref.q3_k_scales(raw.reshape(6, 3, 110)[..., 96:108])
    assert sc.min().item() >= 0 and sc.max().item() <= 63 and sc.unique().numel() >= 56


def test_test_quantizer_blocks_read_back_with_gguf():
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 512)) * 0.1).astype(np.float32)
    x[1] += 0.2  # an offset row: signed scales matter
    raw = quantize(x, "Q3_K")
    assert raw.shape == (5, 220) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q3_K)
    # 3-bit round to nearest of Gaussian rows (measured ~0.17).
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.25
    assert np.array_equal(ref.dequantize_gguf(torch.from_numpy(raw), "Q3_K").numpy(), back)


def _check_against_references(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, what) -> None:
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), what
    exact = int8_activation_reference(x, raw, "Q3_K")
    assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item(), what
    want = x.float() @ ref.dequantize_gguf(raw, "Q3_K").t()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2.5e-2, (what, rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    module = native()
    gen = torch.Generator().manual_seed(3)
    with nan_outputs():
        for k in (256, 1536):
            for m in (1, 3, 17, 64):
                n = 40 if m != 17 else 24
                raw = random_q3k(n, k, gen)
                x = torch.randn(m, k, generator=gen).to(dtype)
                got = module.gguf_linear(x, raw, TID)
                _check_against_references(got, x, raw, (k, m))
                bias = torch.randn(n, generator=gen)
                y = cpu_quant.gguf_linear(x, raw, "Q3_K", bias)
                assert y.dtype == dtype
                torch.testing.assert_close(y.float(), (got + bias).to(dtype).float(), rtol=0, atol=0)
    whole = module.gguf_linear(x, raw, TID)
    for i in (0, 8, 16):
        assert torch.equal(module.gguf_linear(x[i : i + 1], raw, TID)[0], whole[i])


def test_bad_shapes_are_refused_and_odd_rows_keep_blocks():
    module = native()
    raw = torch.zeros(4, 220, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.gguf_linear(torch.randn(1, 224), raw[:, :110], TID)
    with pytest.raises(RuntimeError, match="bytes"):
        module.gguf_linear(torch.randn(1, 256), raw[:, :100], TID)
    odd = torch.zeros(24, 110, dtype=torch.uint8)  # rows not a multiple of 16: the row kernel's blocks
    assert cpu_quant.prepare_gguf_weight(odd, "Q3_K") is odd


def _tiled_module():
    module = native()
    if not (module.has_packed() and module.has_kpacked(TID)):
        pytest.skip("no AVX-512 VNNI tiled Q3_K kernel here")
    return module


def test_repacking_is_lossless():
    module = _tiled_module()
    gen = torch.Generator().manual_seed(4)
    noise = torch.randint(0, 256, (48, 3 * 110), dtype=torch.uint8, generator=gen)  # any bit pattern
    packed = cpu_quant.prepare_gguf_weight(noise, "Q3_K")
    assert packed.shape == (3, 3, 1760) and packed.dtype == torch.uint8 and packed.nbytes == noise.nbytes
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, "Q3_K"), noise)
    ids = torch.tensor([47, 0, 16, 16, 5, 31])
    assert torch.equal(module.unpack_rows(packed, TID, ids), noise[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        module.unpack_rows(packed, TID, torch.tensor([48]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 256 and the default model's 1536,
    1-17 rows (partial row tiles); outputs poisoned; rows batch invariant."""
    module = _tiled_module()
    gen = torch.Generator().manual_seed(5)
    for n, k in ((80, 256), (32, 1536)):
        raw = random_q3k(n, k, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, "Q3_K")
        assert packed.dim() == 3 and packed.nbytes == raw.nbytes
        for m in (1, 3, 4, 7, 17):
            x = torch.randn(m, k, generator=gen).to(dtype)
            with nan_outputs():
                tiled = module.gguf_linear(x, packed, TID)
                rows = module.gguf_linear(x, raw, TID)
            _check_against_references(tiled, x, raw, (n, k, m))
            assert ((tiled - rows).abs().max() / rows.abs().max()).item() < 1e-5
            for i in {0, m // 2, m - 1}:
                assert torch.equal(module.gguf_linear(x[i : i + 1], packed, TID)[0], tiled[i])
            bias = torch.randn(n, generator=gen)
            with nan_outputs():
                out = cpu_quant.gguf_linear(x, packed, "Q3_K", bias)
                out32 = cpu_quant.gguf_linear(x, packed, "Q3_K", bias, torch.float32)
            assert out.dtype == dtype and out32.dtype == torch.float32
            torch.testing.assert_close(out.float(), (tiled + bias).to(dtype).float(), rtol=0, atol=0)
            torch.testing.assert_close(out32, tiled + bias, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.gguf_linear(torch.randn(1, 512), packed, TID)
    # No gated kernel for Q3_K: the fused op takes the two ops in sequence.
    from pagedserve.testing.target import select_target

    silu_and_mul = select_target("cpu").ops.get("silu_and_mul")
    gated = cpu_quant.make_gguf_linear_silu_and_mul(cpu_quant.gguf_linear, silu_and_mul)
    x = torch.randn(5, 1536, generator=gen).bfloat16()
    assert torch.equal(gated(x, packed, "Q3_K"), silu_and_mul(cpu_quant.gguf_linear(x, packed, "Q3_K")))


def test_embedding_rows_come_from_the_repacked_weight():
    _tiled_module()
    gen = torch.Generator().manual_seed(6)
    raw = random_q3k(96, 512, gen)
    ids = torch.tensor([95, 0, 17, 17, 40, 3, 95, 64])
    w = GGUFWeight(
        "Q3_K", raw, 512, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight, embed_op=cpu_quant.gguf_embedding
    )
    prepared = w.prepared()
    assert prepared.data is None and prepared.packed.dim() == 3 and prepared.embeds_prepared
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize_gguf(raw, "Q3_K")[ids].to(dtype)
        assert torch.equal(prepared.embedding(ids, dtype), want)


def test_cpu_declares_the_type_and_a_load_keeps_it():
    from pagedserve.platforms.ops import GGUF_EXTENDED, OpRegistry
    from pagedserve.testing.target import select_target

    cap = ref.gguf_type_capability("Q3_K")
    native()
    ops = select_target("cpu").ops
    assert ops.has_capability("gguf_linear", cap) and "Q3_K" in gguf_kept_types(ops)
    # A gguf_linear that does not declare it (the reference, or one with the extended types
    # only) gets Q3_K dequantized at load.
    plain = OpRegistry()
    assert "Q3_K" not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    assert "Q3_K" not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(cap,))
    assert "Q3_K" in gguf_kept_types(plain)


def test_cpu_conformance_cases_for_q3k():
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    native()
    target = select_target("cpu")
    checks = [c for c in op_checks(target) if c.id.startswith("op:gguf_linear[") and "Q3_K" in c.id]
    assert len(checks) >= 2 * 5  # dtypes x shapes
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


TRITON_SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from test_quant_gguf_q3k import random_q3k
from test_quant_kernels import rel_err
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(1)
for m, n in ((1, 24), (3, 40)):
    raw = random_q3k(n, 512, gen)
    raw[:, 96:108] = torch.randint(0, 256, (n, 12), dtype=torch.uint8, generator=gen)  # every scale bit
    x = torch.randn(m, 512, generator=gen)
    b = torch.randn(n, generator=gen)
    out = gguf_linear_triton(x.to(dev), raw.to(dev), "Q3_K", b.to(dev)).cpu()
    err = rel_err(out, ref.gguf_linear(x, raw, "Q3_K", b))
    assert err < 1e-5, (m, n, err)
print("ok")
"""


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(TRITON_SCRIPT)


# --- a tiny llama GGUF with Q3_K ------------------------------------------------------

_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: Layer 0: Q3_K everywhere (fused q/k/v and gate/up of one type); layer 1: Q3_K beside
#: other kept types in the fused projections (Q4_K v, Q6_K up) and a Q8_0 output.
LAYER_TYPES = (
    dict.fromkeys(_PARTS, "Q3_K"),
    dict(zip(_PARTS, ("Q3_K", "Q3_K", "Q4_K", "Q8_0", "Q3_K", "Q6_K", "Q3_K"))),
)
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2


def write_q3k_gguf(path, seed: int = 0):
    """A 2-layer Llama GGUF with LAYER_TYPES, a tied Q3_K embedding and the byte-level test
    tokenizer (its 261 rows: the LM head keeps the row kernel's blocks)."""
    return write_tiny_llama_gguf(
        path,
        LAYER_TYPES,
        "Q3_K",
        hidden=HIDDEN,
        inter=INTER,
        heads=HEADS,
        kv_heads=KV_HEADS,
        name="tiny q3_k llama",
        seed=seed,
    )


def test_q3k_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        for field in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer0, field)
            assert isinstance(w, GGUFWeight) and w.type_name == "Q3_K", field
            if module.has_packed() and module.has_kpacked(TID):
                assert w.packed is not None and w.packed.dim() == 3, field  # repacked for the tiled kernel
        assert isinstance(layer1.qkv, StackedWeight) and [p.type_name for p in layer1.qkv.parts] == ["Q3_K", "Q4_K"]
        assert [p.type_name for p in layer1.gate_up.parts] == ["Q3_K", "Q6_K"]
        assert layer1.o.type_name == "Q8_0" and layer1.down.type_name == "Q3_K"
        assert model.lm_head.type_name == "Q3_K"  # the tied embedding's blocks (261 rows)

    check_kept_against_dequantized(write_q3k_gguf(tmp_path / "q3k.gguf"), check)
