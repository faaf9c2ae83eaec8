"""IQ4_XS kept in its blocks on the CPU (kernels/cpu/quant_gguf_iq4xs.cpp).

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer's IQ4_XS blocks read back through ``gguf.quants``.
- The CPU's row kernel (the file's blocks) and tiled kernel (blocks repacked at load)
  against the reference, outputs poisoned (NaN) first: within float32 summation of the
  product with the activations rounded to int8 blocks as the kernels round them, and within
  the int8-activation error (relative 2.5e-2) of the float reference; every row the same
  alone; the repacking lossless (native and torch inverses), embedding rows read from it;
  the gated and stacked ops (one native call where the build has the gated tiles) the plain
  op's numbers.
- The CPU declares ``gguf_type:IQ4_XS`` and a load keeps IQ4_XS; the kit's conformance cases
  for it; the Triton kernel under the interpreter.
- A tiny random Llama GGUF with IQ4_XS tensors (alone, fused with IQ4_XS, beside Q8_0 / Q4_K /
  IQ4_NL in fused projections, and the tied embedding) loads each kept and gives the
  dequantized model's logprobs within the int8-activation error (exactly with the reference
  op on the kept blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import quantize, run_triton_interpreted, write_tiny_llama_gguf
from test_quant_gguf_kquants import check_kept_against_dequantized, int8_activation_reference, nan_outputs, native

from pagedserve.kernels import quant_reference as ref
from pagedserve.models.layers import fuse
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, gguf_kept_types

T = "IQ4_XS"
TID = ref.GGUF_TYPE_IDS[T]


def random_iq4xs(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 136]: random nibbles and 6-bit scales, fp16 d of realistic size (a
    weight of up to d * 32 * 127 ~ 0.09)."""
    raw = torch.randint(0, 256, (n, k // 256, 136), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.02 + 1e-3) / 256
    raw[..., 0:2] = d.half().view(torch.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def random_blocks(n: int, k: int, gen: torch.Generator, type_name: str = T) -> torch.Tensor:
    """Blocks of IQ4_XS (random_iq4xs) or of another type (by the test quantizer, from
    Gaussian rows)."""
    if type_name == T:
        return random_iq4xs(n, k, gen)
    x = torch.randn(n, k, generator=gen) * 0.05
    return torch.from_numpy(quantize(x.numpy(), type_name))


# --- format ----------------------------------------------------------------------------


def test_format_constants():
    import gguf

    from pagedserve.loader.gguf_reader import GGML_TYPES

    assert ref.GGUF_BLOCK_BYTES[T] == 136 and ref.GGUF_BLOCK_VALUES[T] == 256 and ref.gguf_row_bytes(T, 512) == 272
    assert TID == 23 and GGML_TYPES[TID].name == T and T in ref.GGUF_OPTIONAL_TYPES
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_XS] == (256, 136)
    assert ref.gguf_type_capability(T) == "gguf_type:IQ4_XS"


def test_reference_dequantizer_matches_gguf_quants():
    import gguf

    gen = torch.Generator().manual_seed(1)
    raw = random_iq4xs(6, 768, gen)
    # d of any sign and size too (NaN/inf fp16 fields left out of the comparison).
    mixed = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
    for data in (raw, mixed):
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.IQ4_XS)
        got = ref.dequantize_gguf(data, T)
        finite = np.isfinite(want)
        assert got.shape == want.shape == (6, 768) and finite.mean() > 0.5
        np.testing.assert_array_equal(got.numpy()[finite], want[finite])
    # The random blocks exercise (nearly) every 6-bit scale, both ends included.
    sc = ref.iq4_xs_scales(raw.reshape(6, 3, 136))
    assert sc.min().item() == -32 and sc.max().item() == 31 and sc.unique().numel() >= 56


def test_test_quantizer_blocks_read_back_with_gguf():
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 512)) * 0.1).astype(np.float32)
    x[1] += 0.2  # an offset row: signed scales matter
    x[2, :32] = 0  # an all-zero sub-block beside non-zero ones
    x[3, 256:] = 0  # an all-zero super-block
    raw = quantize(x, T)
    assert raw.shape == (5, 272) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_XS)
    # Non-linear 4-bit round to nearest with 6-bit sub-block scales of Gaussian rows (measured 0.070).
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.09
    assert not back[2, :32].any() and not back[3, 256:].any()
    assert np.array_equal(ref.dequantize_gguf(torch.from_numpy(raw), T).numpy(), back)


# --- the native kernels ------------------------------------------------------------------


def _check_against_references(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, what) -> None:
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), what
    exact = int8_activation_reference(x, raw, T)
    assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item(), what
    want = x.float() @ ref.dequantize_gguf(raw, T).t()
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
                raw = random_iq4xs(n, k, gen)
                x = torch.randn(m, k, generator=gen).to(dtype)
                got = module.gguf_linear(x, raw, TID)
                _check_against_references(got, x, raw, (k, m))
                bias = torch.randn(n, generator=gen)
                y = cpu_quant.gguf_linear(x, raw, T, bias)
                assert y.dtype == dtype
                torch.testing.assert_close(y.float(), (got + bias).to(dtype).float(), rtol=0, atol=0)
    whole = module.gguf_linear(x, raw, TID)
    for i in (0, 8, 16):
        assert torch.equal(module.gguf_linear(x[i : i + 1], raw, TID)[0], whole[i])


def test_bad_shapes_are_refused_and_odd_rows_keep_blocks():
    module = native()
    raw = torch.zeros(4, 272, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.gguf_linear(torch.randn(1, 224), raw[:, :136], TID)
    with pytest.raises(RuntimeError, match="bytes"):
        module.gguf_linear(torch.randn(1, 256), raw[:, :130], TID)
    odd = torch.zeros(24, 136, dtype=torch.uint8)  # rows not a multiple of 16: the row kernel's blocks
    assert cpu_quant.prepare_gguf_weight(odd, T) is odd


def _tiled_module():
    module = native()
    if not (module.has_packed() and module.has_kpacked(TID)):
        pytest.skip("no AVX-512 VNNI tiled IQ4_XS kernel here")
    return module


def test_repacking_is_lossless():
    module = _tiled_module()
    gen = torch.Generator().manual_seed(4)
    noise = torch.randint(0, 256, (48, 3 * 136), dtype=torch.uint8, generator=gen)  # any bit pattern
    packed = cpu_quant.prepare_gguf_weight(noise, T)
    assert packed.shape == (3, 3, 2176) and packed.dtype == torch.uint8 and packed.nbytes == noise.nbytes
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, T), noise)
    ids = torch.tensor([47, 0, 16, 16, 5, 31])
    assert torch.equal(module.unpack_rows(packed, TID, ids), noise[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        module.unpack_rows(packed, TID, torch.tensor([48]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 256 and 1536, 1-17 rows (partial row
    tiles) and 250 (past a 240-row chunk); outputs poisoned; rows batch invariant."""
    module = _tiled_module()
    gen = torch.Generator().manual_seed(5)
    for n, k in ((80, 256), (32, 1536)):
        raw = random_iq4xs(n, k, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, T)
        assert packed.dim() == 3 and packed.nbytes == raw.nbytes
        for m in (1, 3, 4, 7, 17) + ((250,) if k == 256 else ()):
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
                out = cpu_quant.gguf_linear(x, packed, T, bias)
                out32 = cpu_quant.gguf_linear(x, packed, T, bias, torch.float32)
            assert out.dtype == dtype and out32.dtype == torch.float32
            torch.testing.assert_close(out.float(), (tiled + bias).to(dtype).float(), rtol=0, atol=0)
            torch.testing.assert_close(out32, tiled + bias, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.gguf_linear(torch.randn(1, 512), packed, TID)


def test_gated_and_stacked_ops_equal_the_plain_op():
    """The gated op is the two ops in sequence, bit for bit, and runs as one native call
    (the linear op not called) where the build has the gated IQ4_XS tiles; a stacked
    projection of IQ4_XS beside Q8_0 / IQ4_NL parts is each part's own op side by side, in
    one native call."""
    module = _tiled_module()
    from pagedserve.testing.target import select_target

    calls = []

    def linear(x, d, t, b=None, out_dtype=None):
        calls.append(t)
        return cpu_quant.gguf_linear(x, d, t, b, out_dtype)

    gen = torch.Generator().manual_seed(6)
    silu_and_mul = select_target("cpu").ops.get("silu_and_mul")
    gated = cpu_quant.make_gguf_linear_silu_and_mul(linear, silu_and_mul)
    packed = cpu_quant.prepare_gguf_weight(random_iq4xs(64, 512, gen), T)
    x = torch.randn(5, 512, generator=gen).bfloat16()
    assert torch.equal(gated(x, packed, T), silu_and_mul(cpu_quant.gguf_linear(x, packed, T)))
    assert calls == ([] if module.has_kpacked_gated(TID) else [T])
    stacked = cpu_quant.make_gguf_linear_stacked(linear)
    parts = [(T, 48), ("Q8_0", 16), ("IQ4_NL", 32), (T, 32)]
    weights = [cpu_quant.prepare_gguf_weight(random_blocks(n, 512, gen, t), t) for t, n in parts]
    types = [t for t, _ in parts]
    bias = torch.randn(128, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 512, generator=gen).to(dtype)
        at, want = 0, []
        for w, (t, n) in zip(weights, parts):
            want.append(cpu_quant.gguf_linear(x, w, t, bias[at : at + n]))
            at += n
        calls.clear()
        assert torch.equal(stacked(x, weights, types, bias), torch.cat(want, dim=-1))
        assert calls == []


def test_embedding_rows_come_from_the_repacked_weight():
    _tiled_module()
    gen = torch.Generator().manual_seed(7)
    raw = random_iq4xs(96, 512, gen)
    ids = torch.tensor([95, 0, 17, 17, 40, 3, 95, 64])
    w = GGUFWeight(T, raw, 512, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight, embed_op=cpu_quant.gguf_embedding)
    prepared = w.prepared()
    assert prepared.data is None and prepared.packed.dim() == 3 and prepared.embeds_prepared
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize_gguf(raw, T)[ids].to(dtype)
        assert torch.equal(prepared.embedding(ids, dtype), want)


# --- capability, conformance, Triton ----------------------------------------------------------


def test_cpu_declares_the_type_and_a_load_keeps_it():
    from pagedserve.platforms.ops import GGUF_EXTENDED, OP_CAPABILITIES, OpRegistry
    from pagedserve.testing.target import select_target

    cap = ref.gguf_type_capability(T)
    assert cap in OP_CAPABILITIES
    native()
    ops = select_target("cpu").ops
    if not ops.has_capability("gguf_linear", GGUF_EXTENDED):
        pytest.skip("the CPU platform keeps the reference gguf_linear here (PAGEDSERVE_QUANT_CPU_KERNELS=0)")
    assert ops.has_capability("gguf_linear", cap) and T in gguf_kept_types(ops)
    # A gguf_linear that does not declare it (the reference, or one with the extended types
    # only) gets IQ4_XS dequantized at load.
    plain = OpRegistry()
    assert T not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    assert T not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(cap,))
    assert T in gguf_kept_types(plain)


@pytest.mark.parametrize("op", ["gguf_linear", "prepare_gguf_weight", "gguf_embedding"])
def test_cpu_conformance_cases(op):
    """The kit's IQ4_XS cases (rows 1..64, outputs that are and are not multiples of 16, with
    and without bias, float32 and bfloat16) for the CPU's ops."""
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    native()
    target = select_target("cpu")
    if op not in target.overridden_ops():
        pytest.skip(f"the CPU platform keeps the reference {op} here")
    checks = [c for c in op_checks(target) if c.id.startswith(f"op:{op}[") and T in c.id]
    assert len(checks) >= 2
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


TRITON_SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from test_quant_gguf_iq4xs import random_iq4xs
from test_quant_kernels import rel_err
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(8)
for m, n in ((1, 24), (3, 40)):
    raw = random_iq4xs(n, 512, gen)
    x = torch.randn(m, 512, generator=gen)
    b = torch.randn(n, generator=gen)
    out = gguf_linear_triton(x.to(dev), raw.to(dev), "IQ4_XS", b.to(dev)).cpu()
    err = rel_err(out, ref.gguf_linear(x, raw, "IQ4_XS", b))
    assert err < 1e-5, (m, n, err)
print("ok")
"""


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(TRITON_SCRIPT)


# --- a tiny llama GGUF with IQ4_XS ------------------------------------------------------

_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: Layer 0: IQ4_XS everywhere (fused q/k/v and gate/up of one type); layer 1: IQ4_XS beside
#: other kept types in the fused projections (Q8_0 v, IQ4_NL up: llama-quantize's fallbacks
#: for rows not a multiple of 256) and a Q4_K output.
LAYER_TYPES = (
    dict.fromkeys(_PARTS, T),
    dict(zip(_PARTS, (T, T, "Q8_0", "Q4_K", T, "IQ4_NL", T))),
)
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2


def write_iq4xs_gguf(path, seed: int = 0):
    """A 2-layer Llama GGUF with LAYER_TYPES, a tied IQ4_XS embedding and the byte-level test
    tokenizer (its 261 rows: the LM head keeps the row kernel's blocks)."""
    return write_tiny_llama_gguf(
        path,
        LAYER_TYPES,
        T,
        hidden=HIDDEN,
        inter=INTER,
        heads=HEADS,
        kv_heads=KV_HEADS,
        name="tiny iq4_xs llama",
        seed=seed,
    )


def test_iq4xs_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        for field in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer0, field)
            assert isinstance(w, GGUFWeight) and w.type_name == T, field
            if module.has_packed() and module.has_kpacked(TID):
                assert w.packed is not None and w.packed.dim() == 3, field  # repacked for the tiled kernel
        assert isinstance(layer1.qkv, StackedWeight) and [p.type_name for p in layer1.qkv.parts] == [T, "Q8_0"]
        assert [p.type_name for p in layer1.gate_up.parts] == [T, "IQ4_NL"]
        assert layer1.o.type_name == "Q4_K" and layer1.down.type_name == T
        head = model.lm_head
        assert head.type_name == T and head.out_features % 16 and head.packed is None  # 261 rows: the row kernel's

    check_kept_against_dequantized(write_iq4xs_gguf(tmp_path / "iq4xs.gguf"), check, greedy=True)


def test_fuse_keeps_iq4xs_in_its_own_blocks():
    gen = torch.Generator().manual_seed(9)

    def w(type_name: str, rows: int) -> GGUFWeight:
        return GGUFWeight(type_name, random_blocks(rows, 256, gen, type_name), 256, cpu_quant.gguf_linear)

    same = fuse([w(T, 32), w(T, 16)])
    assert isinstance(same, GGUFWeight) and same.type_name == T and same.out_features == 48
    for other in ("Q8_0", "IQ4_NL", "Q4_K"):
        parts = [w(T, 32), w(T, 16), w(other, 16)]
        fused = fuse(parts)
        assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == [T, other]
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
