"""Q2_K kept in its blocks (an optional type: the CPU declares ``gguf_type:Q2_K``), through
the checks every kept type goes through (gguf_type_checks.py):

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

import pytest
import torch
from gguf_blocks import run_triton_interpreted, write_tiny_llama_gguf
from gguf_type_checks import (
    check_bad_shapes_are_refused,
    check_conformance_cases,
    check_cpu_declares_the_type,
    check_dequantizer_against_gguf,
    check_embedding_rows_from_the_repacked_weight,
    check_kept_against_dequantized,
    check_kept_whole,
    check_quantizer_reads_back,
    check_repacking_is_lossless,
    check_row_kernel,
    check_stacked,
    check_tiled_kernel,
    native,
    projections,
    quantizer_rows,
    random_blocks,
    triton_script,
)

from pagedserve.kernels import quant_reference as ref
from pagedserve.quantization.gguf import GGUFWeight

T = "Q2_K"
TID = ref.GGUF_TYPE_IDS[T]


def random_q2k(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k/256 * 84]: random quants and 4-bit scales / minimums, realistic fp16 d, dmin."""
    return random_blocks(T, n, k, gen, fields=(80, 82), size=0.02, divisor=8)


def test_reference_dequantizer_matches_gguf_quants():
    gen = torch.Generator().manual_seed(1)
    check_dequantizer_against_gguf(random_q2k(6, 512, gen), T, gen)
    assert ref.gguf_row_bytes(T, 512) == 168 and ref.GGUF_BLOCK_VALUES[T] == 256


def test_test_quantizer_blocks_read_back_with_gguf():
    check_quantizer_reads_back(quantizer_rows(768), T, 0.35)  # 2 bits: 26% measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    """The file's blocks (what rows not a multiple of 16 keep): 40 and 24 rows, the
    default model's K 1536 and 256; a row alone the same as among 9."""
    gen = check_row_kernel(T, random_q2k, dtype, ks=(256, 1536))
    module = native()
    raw = random_q2k(24, 512, gen)
    x = torch.randn(9, 512, generator=gen)
    whole = module.gguf_linear(x, raw, TID)
    for i in (0, 4, 8):
        assert torch.equal(module.gguf_linear(x[i : i + 1], raw, TID)[0], whole[i])


def test_bad_shapes_are_refused_and_odd_rows_keep_blocks():
    check_bad_shapes_are_refused(T, short_bytes=80)


def test_repacking_is_lossless():
    check_repacking_is_lossless(T, torch.Generator().manual_seed(10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference(dtype):
    """80 columns (5 groups: a partial column tile) and 32; K 256 and 1536; row counts
    over partial row tiles.  The tiled kernel equals the int8-activation product to
    float32 summation order, the row kernel to float32 rounding, every output written,
    each row alone bit for bit the same as among others; bias and x's dtype out."""
    gen = torch.Generator().manual_seed(11)
    check_tiled_kernel(T, random_q2k, gen, (dtype,), ((80, 256), (32, 1536)), rows=(1, 3, 4, 5, 7, 17, 64))


def test_embedding_rows_come_from_the_repacked_weight():
    check_embedding_rows_from_the_repacked_weight(T, random_q2k(96, 512, torch.Generator().manual_seed(12)))


def test_cpu_declares_the_type_and_a_load_keeps_it():
    check_cpu_declares_the_type(T)


@pytest.mark.parametrize("op, at_least", [("gguf_linear", 2 * 5), ("prepare_gguf_weight", 2), ("gguf_embedding", 4)])
def test_cpu_conformance_cases(op, at_least):
    """At least float32 and bfloat16 x 5 shapes of gguf_linear, 2 dtypes x 2 embedding
    sizes (prepare_gguf_weight's cases too where the build repacks for its tiled kernel)."""
    check_conformance_cases(op, T, at_least)


# --- a tiny llama GGUF with Q2_K projections ----------------------------------------------

#: Layer 0: Q2_K beside Q8_0 (qkv) and Q4_K (gate/up); layer 1: all Q2_K.
LAYER_TYPES = (projections(T, attn_v="Q8_0", ffn_up="Q4_K"), projections(T))
INTER = 512


def test_q2k_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers[0], model.layers[1]
        # Q2_K parts stay Q2_K: beside Q8_0 / Q4_K as runs of one type, alone fused whole.
        check_stacked(layer0.qkv, [T, "Q8_0"])
        check_stacked(layer0.gate_up, [T, "Q4_K"])
        check_kept_whole(layer1, T)
        for w in (layer0.o, layer0.down, layer1.qkv, layer1.o, layer1.gate_up, layer1.down, model.lm_head):
            assert isinstance(w, GGUFWeight) and w.type_name == T
        assert layer1.gate_up.out_features == 2 * INTER
        if module.has_kpacked(TID):  # repacked at load where the tiled kernel is built
            assert layer1.down.packed is not None and layer1.down.packed.dim() == 3

    # A tied Q2_K embedding (261 rows: not a multiple of 16, so the row kernel's).
    path = write_tiny_llama_gguf(tmp_path / "q2k.gguf", LAYER_TYPES, T, inter=INTER, name="tiny q2_k llama")
    check_kept_against_dequantized(path, check)


def test_triton_kernel_takes_q2k_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(triton_script(T, "test_quant_gguf_q2k:random_q2k", 1, ((1, 24, 512), (3, 40, 512))))
