"""IQ4_NL (ggml's non-linear 4-bit blocks) kept in its blocks on the CPU, through the checks
every kept type goes through (gguf_type_checks.py):

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer (gguf_blocks.py) writes blocks ``gguf.quants`` reads
  back within the format's rounding.
- The native kernels against the reference on random blocks and activations, outputs
  poisoned (NaN) before they write them: the row kernel (the file's blocks, rows not a
  multiple of 16) and the tiled kernel (repacked at load, Q4_0's entry) within float32
  summation of the product with the activations rounded to int8 blocks as the kernels
  round them, and within the int8-activation allowance of the float reference; the tiled
  kernel equals the row kernel to float32 summation order, each row alone the same as
  among others; the gated and stacked ops are the plain op's numbers bit for bit;
  embedding rows come from the repacked form exactly.
- The CPU declares ``gguf_type:IQ4_NL`` and passes the conformance kit's IQ4_NL cases;
  the Triton kernel takes IQ4_NL under the interpreter.
- A tiny Llama GGUF of IQ4_NL tensors (beside Q8_0 / Q5_0 parts in fused projections)
  loads kept and gives the dequantized model's logprobs within the int8-activation error.
"""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import run_triton_interpreted, write_tiny_llama_gguf
from gguf_type_checks import (
    check_conformance_cases,
    check_cpu_declares_the_type,
    check_dequantizer_against_gguf,
    check_embedding_rows_from_the_repacked_weight,
    check_fuse_keeps_the_type,
    check_kept_against_dequantized,
    check_kept_whole,
    check_quantizer_reads_back,
    check_repacking_is_lossless,
    check_row_kernel,
    check_stacked,
    check_tiled_kernel,
    cpu_silu_and_mul,
    nan_outputs,
    native,
    parts_side_by_side,
    projections,
    quantizer_rows,
    tiled_module,
    triton_script,
)
from gguf_type_checks import random_blocks as blocks_of

from pagedserve.kernels import quant_reference as ref
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight

T = "IQ4_NL"
TID = ref.GGUF_TYPE_IDS[T]


def random_blocks(n: int, k: int, gen: torch.Generator, type_name: str = T) -> torch.Tensor:
    """uint8 [n, row bytes] of a 32-value type: random nibbles with finite, realistic fp16
    scales (d at byte 0; Q4_1 and Q5_1's minimum at byte 2 signed)."""
    raw = blocks_of(type_name, n, k, gen, fields=(0,)).reshape(n, k // 32, -1)
    if type_name in ("Q4_1", "Q5_1"):
        raw[..., 2:4] = (torch.randn(n, k // 32, generator=gen) * 0.05).half().view(torch.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def random_iq4nl(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return random_blocks(n, k, gen)


# --- format ----------------------------------------------------------------------------


def test_reference_dequantizer_matches_gguf_quants():
    import gguf

    gen = torch.Generator().manual_seed(1)
    check_dequantizer_against_gguf(random_blocks(6, 512, gen), T, gen)
    assert ref.IQ4_NL_VALUES == tuple(int(v) for v in gguf.quants.IQ4_NL.kvalues)
    assert ref.GGUF_BLOCK_BYTES[T] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL][1]


def test_test_quantizer_blocks_read_back_with_gguf():
    x = quantizer_rows(768)
    x[2, :32] = 0  # an all-zero block
    back = check_quantizer_reads_back(x, T, 0.08)  # measured 0.071
    assert not back[2, :32].any()


# --- the native kernels ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    """The file's blocks (the row kernel): K 96 and the default model's 576 and 1536."""
    check_row_kernel(T, random_iq4nl, dtype, ks=(96, 576, 1536))


def test_repacking_is_lossless_and_q4_0s_layout():
    module = tiled_module(T)
    packed = check_repacking_is_lossless(T, torch.Generator().manual_seed(4), blocks=5)
    noise = cpu_quant.unpack_gguf_weight(packed, T)
    assert torch.equal(packed, module.pack_weight(noise, ref.GGUF_TYPE_IDS["Q4_0"]))
    # Rows not a multiple of 16 keep the file's blocks (the row kernel's).
    assert cpu_quant.prepare_gguf_weight(noise[:40], T).dim() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 96, 576 and 1536; rows over the few-row
    tiles, partial row tiles and a 240-row chunk boundary."""
    gen = torch.Generator().manual_seed(5)
    shapes = ((80, 96), (32, 576), (48, 1536))
    check_tiled_kernel(T, random_iq4nl, gen, (dtype,), shapes, first_shape_rows=(250,), wrong_k=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_op_is_the_two_ops_bit_for_bit(dtype):
    module = tiled_module(T)
    if not module.has_packed_gated():
        pytest.skip("no gated tiled kernel here")
    silu_and_mul = cpu_silu_and_mul()
    gated = cpu_quant.make_gguf_linear_silu_and_mul(cpu_quant.gguf_linear, silu_and_mul)
    gen = torch.Generator().manual_seed(6)
    for d in (16, 48):  # one and three column groups per half
        raw = random_blocks(2 * d, 576, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, T)
        for m in (1, 5, 17):
            x = torch.randn(m, 576, generator=gen).to(dtype)
            bias = torch.randn(2 * d, generator=gen)
            with nan_outputs():
                got = module.gguf_linear_silu_out(x, packed, TID, bias)
            want = silu_and_mul(module.gguf_linear_out(x, packed, TID, bias))
            assert got.shape == (m, d) and torch.equal(got, want)
            assert torch.equal(gated(x, packed, T), silu_and_mul(cpu_quant.gguf_linear(x, packed, T)))
            for i in {0, m - 1}:
                assert torch.equal(module.gguf_linear_silu_out(x[i : i + 1], packed, TID, bias)[0], got[i])


@pytest.mark.parametrize("other", ["Q8_0", "Q5_0", "Q4_0"])
def test_stacked_op_runs_iq4_nl_beside_other_types_in_one_call(other):
    """IQ4_NL [q; k] beside another 32-value type's v: one native call, each part's columns
    bit for bit its own op's; beside Q4_1 (fp16 activation sums, quantized apart) too."""
    module = tiled_module(T)
    gen = torch.Generator().manual_seed(7)
    stacked = cpu_quant.make_gguf_linear_stacked(cpu_quant.gguf_linear)
    parts = [(T, 48), (other, 16), (T, 32)]
    raws = [random_blocks(n, 576, gen, t) for t, n in parts]
    weights = [cpu_quant.prepare_gguf_weight(r, t) for r, (t, _) in zip(raws, parts)]
    types = [t for t, _ in parts]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 576, generator=gen).to(dtype)
        bias = torch.randn(96, generator=gen)
        with nan_outputs():
            got = module.gguf_linear_multi_out(x, weights, [ref.GGUF_TYPE_IDS[t] for t in types], bias)
        assert torch.equal(got, stacked(x, weights, types, bias))
        assert torch.equal(got, parts_side_by_side(x, weights, types, bias))
    q41 = random_blocks(16, 576, gen, "Q4_1")
    mixed = [weights[0], cpu_quant.prepare_gguf_weight(q41, "Q4_1")]
    x = torch.randn(3, 576, generator=gen)
    assert torch.equal(stacked(x, mixed, [T, "Q4_1"]), parts_side_by_side(x, mixed, [T, "Q4_1"]))


def test_embedding_rows_come_from_the_repacked_weight():
    check_embedding_rows_from_the_repacked_weight(T, random_blocks(96, 576, torch.Generator().manual_seed(8)))


# --- capability, conformance, Triton ----------------------------------------------------------


def test_cpu_declares_the_capability_and_keeps_the_type():
    check_cpu_declares_the_type(T)


@pytest.mark.parametrize(
    "op", ["gguf_linear", "prepare_gguf_weight", "gguf_embedding", "gguf_linear_silu_and_mul", "gguf_linear_stacked"]
)
def test_cpu_conformance_cases(op):
    """The kit's IQ4_NL cases (rows 1..300, outputs that are and are not multiples of 16,
    with and without bias, float32 and bfloat16; mixes with other types) for the CPU's ops."""
    check_conformance_cases(op, T, at_least=4)


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(triton_script(T, "test_quant_gguf_iq4nl:random_iq4nl", 9, ((1, 24, 64), (3, 40, 96))))


# --- a tiny Llama GGUF of IQ4_NL tensors ----------------------------------------------------

#: Per layer, each projection's type: all IQ4_NL, then IQ4_NL beside Q8_0 (v) and Q5_0 (up).
LAYER_TYPES = (projections(T), projections(T, attn_v="Q8_0", ffn_up="Q5_0"))


def test_iq4_nl_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers
        check_kept_whole(layer0, T)
        for w in (layer1.o, layer1.down):
            assert isinstance(w, GGUFWeight) and w.type_name == T
            assert (w.packed is not None) == module.has_packed()  # repacked at load where the tiled kernel is built
        # IQ4_NL beside Q8_0 / Q5_0: a StackedWeight, each part in its own type (one native call;
        # IQ4_NL is not widened to Q8_0, which would hold its values but nearly double its bytes).
        check_stacked(layer1.qkv, [T, "Q8_0"])
        check_stacked(layer1.gate_up, [T, "Q5_0"])
        head = model.lm_head
        assert isinstance(head, GGUFWeight) and head.type_name == T
        assert head.out_features % 16 and head.packed is None  # the vocabulary: the row kernel's

    # Hidden 128, a tied IQ4_NL embedding (its row count, the byte-level test vocabulary's,
    # not a multiple of 16: the row kernel's).
    path = write_tiny_llama_gguf(
        tmp_path / "iq4nl.gguf", LAYER_TYPES, T, hidden=128, inter=256, name="tiny iq4_nl llama"
    )
    check_kept_against_dequantized(path, check, greedy=True)


def test_fuse_keeps_iq4_nl_in_its_own_blocks():
    check_fuse_keeps_the_type(T, random_blocks, 64, ("Q8_0", "Q4_0", "Q5_0"), torch.Generator().manual_seed(10))
