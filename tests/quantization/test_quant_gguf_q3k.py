"""Q3_K kept in its blocks on the CPU (kernels/cpu/quant_gguf_q3k.cpp), through the checks
every kept type goes through (gguf_type_checks.py):

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

import pytest
import torch
from gguf_blocks import run_triton_interpreted, write_tiny_llama_gguf
from gguf_type_checks import (
    check_bad_shapes_are_refused,
    check_conformance_cases,
    check_cpu_declares_the_type,
    check_dequantizer_against_gguf,
    check_embedding_rows_from_the_repacked_weight,
    check_gated_op_is_the_two_ops,
    check_kept_against_dequantized,
    check_kept_whole,
    check_quantizer_reads_back,
    check_repacking_is_lossless,
    check_row_kernel,
    check_stacked,
    check_tiled_kernel,
    projections,
    quantizer_rows,
    random_blocks,
    triton_script,
)

from pagedserve.kernels import quant_reference as ref

T = "Q3_K"
TID = ref.GGUF_TYPE_IDS[T]


def random_q3k(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 110]: random quants and scales, fp16 d of realistic size (a weight
    of up to d * 32 * 4 ~ 0.1)."""
    return random_blocks(T, n, k, gen, fields=(108,), size=0.02, divisor=32)


def test_format_constants():
    assert ref.GGUF_BLOCK_BYTES[T] == 110 and ref.GGUF_BLOCK_VALUES[T] == 256
    assert TID == 11 and T in ref.GGUF_OPTIONAL_TYPES
    assert ref.gguf_type_capability(T) == "gguf_type:Q3_K"


def test_reference_dequantizer_matches_gguf_quants():
    gen = torch.Generator().manual_seed(1)
    raw = random_q3k(6, 768, gen)
    check_dequantizer_against_gguf(raw, T, gen)
    # The random blocks exercise (nearly) every 6-bit scale.
    sc = ref.q3_k_scales(raw.reshape(6, 3, 110)[..., 96:108])
    assert sc.min().item() >= 0 and sc.max().item() <= 63 and sc.unique().numel() >= 56


def test_test_quantizer_blocks_read_back_with_gguf():
    # 3-bit round to nearest of Gaussian rows (measured ~0.17).
    check_quantizer_reads_back(quantizer_rows(512), T, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    check_row_kernel(T, random_q3k, dtype, ks=(256, 1536))


def test_bad_shapes_are_refused_and_odd_rows_keep_blocks():
    check_bad_shapes_are_refused(T, short_bytes=100)


def test_repacking_is_lossless():
    check_repacking_is_lossless(T, torch.Generator().manual_seed(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 256 and the default model's 1536,
    1-17 rows (partial row tiles); outputs poisoned; rows batch invariant; the gated op on
    the last weight the two ops' bits."""
    gen = torch.Generator().manual_seed(5)
    packed = check_tiled_kernel(T, random_q3k, gen, (dtype,), ((80, 256), (32, 1536)))
    check_gated_op_is_the_two_ops(packed, T, torch.randn(5, 1536, generator=gen).bfloat16())


def test_embedding_rows_come_from_the_repacked_weight():
    check_embedding_rows_from_the_repacked_weight(T, random_q3k(96, 512, torch.Generator().manual_seed(6)))


def test_cpu_declares_the_type_and_a_load_keeps_it():
    check_cpu_declares_the_type(T)


def test_cpu_conformance_cases_for_q3k():
    check_conformance_cases("gguf_linear", T, at_least=2 * 5)  # dtypes x shapes


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(triton_script(T, "test_quant_gguf_q3k:random_q3k", 1, ((1, 24, 512), (3, 40, 512))))


# --- a tiny llama GGUF with Q3_K ------------------------------------------------------

#: Layer 0: Q3_K everywhere (fused q/k/v and gate/up of one type); layer 1: Q3_K beside
#: other kept types in the fused projections (Q4_K v, Q6_K up) and a Q8_0 output.
LAYER_TYPES = (projections(T), projections(T, attn_v="Q4_K", attn_output="Q8_0", ffn_up="Q6_K"))


def test_q3k_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        check_kept_whole(layer0, T)
        check_stacked(layer1.qkv, [T, "Q4_K"])
        check_stacked(layer1.gate_up, [T, "Q6_K"])
        assert layer1.o.type_name == "Q8_0" and layer1.down.type_name == T
        assert model.lm_head.type_name == T  # the tied embedding's blocks (261 rows)

    # A tied Q3_K embedding of the byte-level test tokenizer's 261 rows: the LM head keeps
    # the row kernel's blocks.
    check_kept_against_dequantized(
        write_tiny_llama_gguf(tmp_path / "q3k.gguf", LAYER_TYPES, T, name="tiny q3_k llama"), check
    )
