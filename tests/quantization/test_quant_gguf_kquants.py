"""Q5_0, Q5_1, Q4_K, Q5_K and Q6_K kept in their blocks, and GGUF files mixing types.

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer (gguf_blocks.py) writes blocks ``gguf.quants``
  reads back within each format's rounding.
- The CPU kernel against the reference on random blocks and activations, outputs
  poisoned (NaN) before it writes them: within float32 summation rounding of the same
  product with the activations rounded to int8 blocks as the kernel rounds them, and
  within the int8-activation error (relative 2.5e-2, the ``gguf_linear`` allowance;
  ~0.5% measured) of the float reference.
- The checks every kept type goes through (gguf_type_checks.py: the row kernel, the
  tiled kernel and its lossless repacking, embedding rows) for each of these types.
- A tiny random Llama GGUF whose q/k/v and gate/up mix types (and an F16 part) loads
  with each tensor kept in its type and gives the dequantized model's logprobs within the
  int8-activation error.
"""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_blocks import QUANTIZERS, write_tiny_llama_gguf
from gguf_type_checks import (
    EMBED_IDS,
    PARTS,
    check_bad_shapes_are_refused,
    check_dequantizer_against_gguf,
    check_embedding_rows_from_the_repacked_weight,
    check_gated_op_is_the_two_ops,
    check_kept_against_dequantized,
    check_quantizer_reads_back,
    check_repacking_is_lossless,
    check_row_kernel,
    check_tiled_kernel,
    int8_activation_reference,
    nan_outputs,
    native,
    quantizer_rows,
    random_blocks,
)

from pagedserve.kernels import quant_reference as ref
from pagedserve.models.layers import fuse
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUF_KEPT_TYPES, GGUFWeight, StackedWeight, gguf_kept_types, widen_blocks

EXTENDED = ref.GGUF_EXTENDED_TYPES
#: Relative error of one format's round-to-nearest on Gaussian rows (measured 1.7-7.1%; Q2_K 26%).
QUANTIZER_ERROR = {
    "Q5_0": 0.06,
    "Q5_1": 0.05,
    "Q3_K": 0.25,
    "Q4_K": 0.1,
    "Q5_K": 0.05,
    "Q6_K": 0.03,
    "Q2_K": 0.35,
    "IQ4_NL": 0.08,
    "IQ4_XS": 0.09,
}


def _random(type_name: str):
    return lambda n, k, gen: random_blocks(type_name, n, k, gen)


@pytest.mark.parametrize("type_name", EXTENDED)
def test_reference_dequantizer_matches_gguf_quants(type_name):
    gen = torch.Generator().manual_seed(1)
    check_dequantizer_against_gguf(random_blocks(type_name, 6, 512, gen), type_name, gen)


@pytest.mark.parametrize("type_name", list(QUANTIZERS))
def test_test_quantizer_blocks_read_back_with_gguf(type_name):
    check_quantizer_reads_back(quantizer_rows(768), type_name, QUANTIZER_ERROR[type_name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", EXTENDED)
def test_cpu_kernel_matches_reference(type_name, dtype):
    # The default model's K (576: Q5_x only, a multiple of 32 but not of 256; 1536) and small ones.
    ks = (256, 1536) if ref.GGUF_BLOCK_VALUES[type_name] == 256 else (96, 576)
    check_row_kernel(type_name, _random(type_name), dtype, ks)


def test_cpu_kernel_rows_are_batch_invariant():
    module = native()
    gen = torch.Generator().manual_seed(4)
    for type_name in EXTENDED:
        raw = random_blocks(type_name, 24, 512, gen)
        x = torch.randn(17, 512, generator=gen)
        whole = module.gguf_linear(x, raw, ref.GGUF_TYPE_IDS[type_name])
        for i in (0, 8, 16):
            assert torch.equal(module.gguf_linear(x[i : i + 1], raw, ref.GGUF_TYPE_IDS[type_name])[0], whole[i])


def test_cpu_kernel_refuses_bad_shapes():
    check_bad_shapes_are_refused("Q4_K", short_bytes=100, k_bytes=126)
    # Rows not a multiple of 16 keep their blocks (the row kernel's), every packed type.
    for type_name in EXTENDED:
        odd = torch.zeros(24, ref.gguf_row_bytes(type_name, 256), dtype=torch.uint8)
        assert cpu_quant.prepare_gguf_weight(odd, type_name).dim() == 2, type_name


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquants_are_repacked_for_the_tiled_kernel(type_name):
    """Q4_K and Q6_K (a Q4_K_M's down projections) and Q5_K (a Q5_K_M's) repack
    losslessly into the file's size;
    the tiled kernel on them matches the int8-activation reference and the row kernel to
    float32 summation order, writes every output (poisoned first), each row alone the
    same as among others; the gated op takes the two ops' bits for them.  80 columns: 5
    groups (a partial column tile); K 256 and the default model's 1536."""
    gen = torch.Generator().manual_seed(11)
    check_repacking_is_lossless(type_name, gen)
    dtypes = (torch.float32, torch.bfloat16)
    packed = check_tiled_kernel(type_name, _random(type_name), gen, dtypes, ((80, 256), (32, 1536)))
    x = torch.randn(5, 1536, generator=gen, dtype=torch.float32).bfloat16()
    check_gated_op_is_the_two_ops(packed, type_name, x)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_embedding_rows_come_from_the_repacked_weight(type_name):
    """A tied embedding reads its rows from the LM head's repacked form: the file's rows
    dequantized exactly, repeated and out-of-order ids included."""
    gen = torch.Generator().manual_seed(12)
    raw = random_blocks(type_name, 96, 512, gen)
    check_embedding_rows_from_the_repacked_weight(type_name, raw)
    module = native()
    # The native row gather against the torch unpacking of the whole weight, every type.
    for t in cpu_quant.PACKED_TYPES:
        if t in cpu_quant.KPACKED_TYPES and not module.has_kpacked(ref.GGUF_TYPE_IDS[t]):
            continue
        k = ref.GGUF_BLOCK_VALUES[t] * 2
        noise = torch.randint(0, 256, (48, ref.gguf_row_bytes(t, k)), dtype=torch.uint8, generator=gen)
        packed = cpu_quant.prepare_gguf_weight(noise, t)
        rows = module.unpack_rows(packed, ref.GGUF_TYPE_IDS[t], torch.tensor([47, 0, 16, 16, 5]))
        assert torch.equal(rows, cpu_quant.unpack_gguf_weight(packed, t)[[47, 0, 16, 16, 5]]), t
        assert torch.equal(rows, noise[[47, 0, 16, 16, 5]]), t
    with pytest.raises(RuntimeError, match="out of range"):
        module.unpack_rows(packed, ref.GGUF_TYPE_IDS[t], torch.tensor([48]))
    # Without a rows op for the prepared form, its rows are refused, not misread.
    bare = GGUFWeight(type_name, raw, 512, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight).prepared()
    assert not bare.embeds_prepared
    with pytest.raises(ValueError, match="repacked at load"):
        bare.embedding(torch.tensor(EMBED_IDS), torch.float32)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_q5_x_is_repacked_for_the_tiled_kernel(type_name):
    """Q5_0 (the bulk of a small model's Q4_K_M) and Q5_1 repack losslessly, and the
    tiled kernel on them matches the int8-activation reference and gives the row kernel's
    result to float32 summation order, each row alone the same as among others; the
    gated op equals the two ops in sequence bit for bit."""
    module = native()
    if not module.has_packed():
        pytest.skip("no AVX-512 VNNI tiled GGUF kernel here")
    gen = torch.Generator().manual_seed(7)
    bb = ref.GGUF_BLOCK_BYTES[type_name]
    # Every byte random (any scale, any bit pattern) for the layout round trip.
    noise = torch.randint(0, 256, (32, 3 * bb), dtype=torch.uint8, generator=gen)
    assert torch.equal(cpu_quant.unpack_gguf_weight(cpu_quant.prepare_gguf_weight(noise, type_name), type_name), noise)
    raw = random_blocks(type_name, 64, 576, gen)
    packed = cpu_quant.prepare_gguf_weight(raw, type_name)
    assert packed.shape == (4, 18, 16 * bb) and packed.dtype == torch.uint8
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, type_name), raw)
    tid = ref.GGUF_TYPE_IDS[type_name]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, 576, generator=gen).to(dtype)
        rows = module.gguf_linear(x, raw, tid)
        with nan_outputs():  # the kernel's output starts as NaN: every element must be written
            tiled = module.gguf_linear(x, packed, tid)
        assert torch.isfinite(tiled).all()
        exact = int8_activation_reference(x, raw, type_name)
        assert (tiled - exact).abs().max().item() <= 2e-5 * exact.abs().max().item()
        assert ((tiled - rows).abs().max() / rows.abs().max()).item() < 1e-5
        assert torch.equal(module.gguf_linear(x[5:6], packed, tid)[0], tiled[5])
        bias = torch.randn(64, generator=gen)
        out = cpu_quant.gguf_linear(x, packed, type_name, bias)
        assert out.dtype == dtype and torch.equal(out, module.gguf_linear_out(x, packed, tid, bias))
        if module.has_packed_gated():
            from pagedserve.testing.target import select_target

            silu_and_mul = select_target("cpu").ops.get("silu_and_mul")
            gated = module.gguf_linear_silu_out(x, packed, tid, bias)
            want = silu_and_mul(module.gguf_linear_out(x, packed, tid, bias))
            assert gated.shape == (17, 32) and torch.equal(gated, want)


def test_fuse_keeps_each_type():
    gen = torch.Generator().manual_seed(5)
    op = cpu_quant.gguf_linear

    def w(type_name: str, rows: int) -> GGUFWeight:
        return GGUFWeight(type_name, random_blocks(type_name, rows, 256, gen), 256, op)

    # Parts that do not convert exactly (Q4_K and Q6_K): runs of one type, one kernel each.
    q, k, v = w("Q4_K", 32), w("Q4_K", 16), w("Q6_K", 16)
    fused = fuse([q, k, v])
    assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == ["Q4_K", "Q6_K"]
    assert fused.parts[0].out_features == 48 and fused.shape == (64, 256)
    same = fuse([w("Q4_K", 16), w("Q4_K", 16)])
    assert isinstance(same, GGUFWeight) and same.type_name == "Q4_K" and same.out_features == 32
    x = torch.randn(3, 256, generator=gen)
    want = x @ torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]).t()
    assert ((fused.apply(x) - want).norm() / want.norm()).item() < 2.5e-2
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))


@pytest.mark.parametrize(
    "types, widest",
    [(("Q5_0", "Q5_0", "Q8_0"), "Q8_0"), (("Q4_0", "Q8_0", "Q5_0"), "Q8_0"), (("Q4_0", "Q5_0"), "Q5_0")]
    + [(("Q4_1", "Q5_1", "Q4_1"), "Q5_1")],
)
def test_fuse_widens_parts_that_convert_exactly(types, widest):
    """A Q4_K_M's [q; k] Q5_0 beside a Q8_0 v: one Q8_0 weight holding exactly the parts'
    values (one kernel call instead of two), its kernel within float32 summation of the
    int8-activation product; the parts keep their rows and order."""
    gen = torch.Generator().manual_seed(13)
    k = 96
    parts = [
        GGUFWeight(t, random_blocks(t, 16 * (i + 1), k, gen), k, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight)
        for i, t in enumerate(types)
    ]
    fused = fuse(parts)
    assert isinstance(fused, GGUFWeight) and fused.type_name == widest
    assert fused.out_features == sum(p.out_features for p in parts)
    assert fused.data.shape == (fused.out_features, ref.gguf_row_bytes(widest, k))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(5, k, generator=gen)
    exact = int8_activation_reference(x, fused.data, widest)
    with nan_outputs():
        outs = [fused.apply(x), fused.prepared().apply(x)]  # the file's layout, then repacked
    for got in outs:
        assert torch.isfinite(got).all()
        assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item()
    with pytest.raises(ValueError, match="do not convert exactly"):
        widen_blocks(parts[0].data, "Q8_0", "Q5_0")


def test_fuse_dequantizes_blocks_beside_a_float_part(caplog):
    gen = torch.Generator().manual_seed(6)
    q = GGUFWeight("Q6_K", random_blocks("Q6_K", 32, 256, gen), 256)
    dense = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    for parts in ([q, dense], [dense, q]):
        with caplog.at_level(logging.INFO, logger="pagedserve.models.layers"):
            fused = fuse(parts)
        assert isinstance(fused, torch.Tensor) and fused.dtype == torch.bfloat16 and fused.shape == (48, 256)
        got = fused[:32] if parts[0] is q else fused[16:]
        assert torch.equal(got, q.dequantize(torch.bfloat16))
        assert "Q6_K" in caplog.text


def test_kept_types_follow_the_capability(caplog):
    from pagedserve.platforms.ops import GGUF_EXTENDED, OpRegistry
    from pagedserve.quantization.gguf import _log_dequantized

    plain = OpRegistry()
    assert gguf_kept_types(plain) == ref.GGUF_BASE_TYPES
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    # Not the optional types (Q2_K, Q3_K, IQ4_NL): each needs its own capability.
    assert set(gguf_kept_types(plain)) == set(GGUF_KEPT_TYPES) - set(ref.GGUF_OPTIONAL_TYPES) >= set(EXTENDED)
    with caplog.at_level(logging.INFO, logger="pagedserve.quantization.gguf"):
        _log_dequantized({"a": "Q4_K", "b": "Q4_K", "c": "F16", "d": "Q3_K", "e": "Q8_0"}, ref.GGUF_BASE_TYPES)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Q3_K" in lines[0] and "Q4_K" in lines[1] and "2 tensor(s)" in lines[1]


# --- a tiny llama GGUF mixing types --------------------------------------------------

#: Per layer, the ggml type of each projection: fused q/k/v and gate/up of different types,
#: one float part (F16 k in layer 1), every extended type and the base ones.
LAYER_TYPES = (
    dict(zip(PARTS, ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q4_K", "Q6_K", "Q6_K"))),
    dict(zip(PARTS, ("Q5_K", "F16", "Q5_1", "Q6_K", "Q5_0", "Q5_0", "Q4_K"))),
)


def test_mixed_type_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    native()

    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        # Each tensor in its own type, or a wider one holding the same values: [q; k] Q5_0
        # and v Q8_0 fused as Q8_0; gate Q4_K and up Q6_K apart; down Q6_K kept.
        assert isinstance(layer0.qkv, GGUFWeight) and layer0.qkv.type_name == "Q8_0"
        assert [p.type_name for p in layer0.gate_up.parts] == ["Q4_K", "Q6_K"]
        assert layer0.down.type_name == "Q6_K" and layer1.down.type_name == "Q4_K"
        assert layer1.gate_up.type_name == "Q5_0" and layer1.o.type_name == "Q6_K"
        assert isinstance(layer1.qkv, torch.Tensor)  # the F16 k: fused as floats
        assert model.lm_head.type_name == "Q6_K"  # the tied embedding's prepared copy

    # Hidden 256 (every K-quant fits), a tied Q6_K embedding.
    path = write_tiny_llama_gguf(tmp_path / "mixed.gguf", LAYER_TYPES, "Q6_K", name="tiny mixed llama")
    check_kept_against_dequantized(path, check)
