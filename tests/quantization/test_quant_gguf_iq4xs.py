"""IQ4_XS kept in its blocks on the CPU (kernels/cpu/quant_gguf_iq4xs.cpp), through the
checks every kept type goes through (gguf_type_checks.py):

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

import pytest
import torch
from gguf_blocks import quantize, run_triton_interpreted, write_tiny_llama_gguf
from gguf_type_checks import (
    check_bad_shapes_are_refused,
    check_conformance_cases,
    check_cpu_declares_the_type,
    check_dequantizer_against_gguf,
    check_embedding_rows_from_the_repacked_weight,
    check_fuse_keeps_the_type,
    check_gated_op_is_the_two_ops,
    check_kept_against_dequantized,
    check_kept_whole,
    check_quantizer_reads_back,
    check_repacking_is_lossless,
    check_row_kernel,
    check_stacked,
    check_tiled_kernel,
    counting_linear,
    parts_side_by_side,
    projections,
    quantizer_rows,
    tiled_module,
    triton_script,
)
from gguf_type_checks import (
    random_blocks as blocks_of,
)

from pagedserve.kernels import quant_reference as ref
from pagedserve.platforms.cpu import quant_ops as cpu_quant

T = "IQ4_XS"
TID = ref.GGUF_TYPE_IDS[T]


def random_iq4xs(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 136]: random nibbles and 6-bit scales, fp16 d of realistic size (a
    weight of up to d * 32 * 127 ~ 0.09)."""
    return blocks_of(T, n, k, gen, fields=(0,), size=0.02, divisor=256)


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
    gen = torch.Generator().manual_seed(1)
    raw = random_iq4xs(6, 768, gen)
    check_dequantizer_against_gguf(raw, T, gen)
    # The random blocks exercise (nearly) every 6-bit scale, both ends included.
    sc = ref.iq4_xs_scales(raw.reshape(6, 3, 136))
    assert sc.min().item() == -32 and sc.max().item() == 31 and sc.unique().numel() >= 56


def test_test_quantizer_blocks_read_back_with_gguf():
    x = quantizer_rows(512)
    x[2, :32] = 0  # an all-zero sub-block beside non-zero ones
    x[3, 256:] = 0  # an all-zero super-block
    # Non-linear 4-bit round to nearest with 6-bit sub-block scales of Gaussian rows (measured 0.070).
    back = check_quantizer_reads_back(x, T, 0.09)
    assert not back[2, :32].any() and not back[3, 256:].any()


# --- the native kernels ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    check_row_kernel(T, random_iq4xs, dtype, ks=(256, 1536))


def test_bad_shapes_are_refused_and_odd_rows_keep_blocks():
    check_bad_shapes_are_refused(T, short_bytes=130)


def test_repacking_is_lossless():
    check_repacking_is_lossless(T, torch.Generator().manual_seed(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 256 and 1536, 1-17 rows (partial row
    tiles) and 250 (past a 240-row chunk); outputs poisoned; rows batch invariant."""
    gen = torch.Generator().manual_seed(5)
    check_tiled_kernel(T, random_iq4xs, gen, (dtype,), ((80, 256), (32, 1536)), first_shape_rows=(250,))


def test_gated_and_stacked_ops_equal_the_plain_op():
    """The gated op is the two ops in sequence, bit for bit, and runs as one native call
    (the linear op not called) where the build has the gated IQ4_XS tiles; a stacked
    projection of IQ4_XS beside Q8_0 / IQ4_NL parts is each part's own op side by side, in
    one native call."""
    tiled_module(T)
    gen = torch.Generator().manual_seed(6)
    packed = cpu_quant.prepare_gguf_weight(random_iq4xs(64, 512, gen), T)
    check_gated_op_is_the_two_ops(packed, T, torch.randn(5, 512, generator=gen).bfloat16())
    linear, calls = counting_linear()
    stacked = cpu_quant.make_gguf_linear_stacked(linear)
    parts = [(T, 48), ("Q8_0", 16), ("IQ4_NL", 32), (T, 32)]
    weights = [cpu_quant.prepare_gguf_weight(random_blocks(n, 512, gen, t), t) for t, n in parts]
    types = [t for t, _ in parts]
    bias = torch.randn(128, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 512, generator=gen).to(dtype)
        want = parts_side_by_side(x, weights, types, bias)
        calls.clear()
        assert torch.equal(stacked(x, weights, types, bias), want)
        assert calls == []


def test_embedding_rows_come_from_the_repacked_weight():
    check_embedding_rows_from_the_repacked_weight(T, random_iq4xs(96, 512, torch.Generator().manual_seed(7)))


# --- capability, conformance, Triton ----------------------------------------------------------


def test_cpu_declares_the_type_and_a_load_keeps_it():
    check_cpu_declares_the_type(T)


@pytest.mark.parametrize("op", ["gguf_linear", "prepare_gguf_weight", "gguf_embedding"])
def test_cpu_conformance_cases(op):
    """The kit's IQ4_XS cases (rows 1..64, outputs that are and are not multiples of 16, with
    and without bias, float32 and bfloat16) for the CPU's ops."""
    check_conformance_cases(op, T, at_least=2)


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(triton_script(T, "test_quant_gguf_iq4xs:random_iq4xs", 8, ((1, 24, 512), (3, 40, 512))))


# --- a tiny llama GGUF with IQ4_XS ------------------------------------------------------

#: Layer 0: IQ4_XS everywhere (fused q/k/v and gate/up of one type); layer 1: IQ4_XS beside
#: other kept types in the fused projections (Q8_0 v, IQ4_NL up: llama-quantize's fallbacks
#: for rows not a multiple of 256) and a Q4_K output.
LAYER_TYPES = (projections(T), projections(T, attn_v="Q8_0", attn_output="Q4_K", ffn_up="IQ4_NL"))


def test_iq4xs_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        check_kept_whole(layer0, T)
        check_stacked(layer1.qkv, [T, "Q8_0"])
        check_stacked(layer1.gate_up, [T, "IQ4_NL"])
        assert layer1.o.type_name == "Q4_K" and layer1.down.type_name == T
        head = model.lm_head
        assert head.type_name == T and head.out_features % 16 and head.packed is None  # 261 rows: the row kernel's

    # A tied IQ4_XS embedding of the byte-level test tokenizer's 261 rows: the LM head keeps
    # the row kernel's blocks.
    path = write_tiny_llama_gguf(tmp_path / "iq4xs.gguf", LAYER_TYPES, T, name="tiny iq4_xs llama")
    check_kept_against_dequantized(path, check, greedy=True)


def test_fuse_keeps_iq4xs_in_its_own_blocks():
    check_fuse_keeps_the_type(T, random_blocks, 256, ("Q8_0", "IQ4_NL", "Q4_K"), torch.Generator().manual_seed(9))
