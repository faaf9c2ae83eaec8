"""Paged attention of prefill chunks on AVX-512 BF16 register tiles
(kernels/cpu/prefill_attn_bf16.cpp) against kernels/reference.py, on fresh random
inputs, outputs poisoned with NaN first.  Skipped, with the reason, on CPUs without
AVX-512 BF16."""

from __future__ import annotations

import pytest

from pagedserve.kernels.cpu.prefill_attn import bf16_prefill_unavailable_reason, load_bf16_prefill_attention
from tests.kernels.paged_attention_checks import (
    BF16,
    check,
    check_default_model_prefill_chunk,
    check_deterministic_across_calls_and_threads,
    check_mixed_batch,
    check_rejects_bad_block_ids,
    check_unsupported_features_run_the_fallback,
    gen_for,
    load_or_skip,
    over_mixed_batch_shapes,
)
from tests.kernels.test_cpu_kernels import make_batch


@pytest.fixture(scope="module")
def kernel():
    return load_or_skip(
        bf16_prefill_unavailable_reason, load_bf16_prefill_attention, "AVX-512 BF16 prefill attention", "AVX-512 BF16"
    )


@over_mixed_batch_shapes
def test_mixed_batch(kernel, head_size, block_size, heads):
    """Prefills from scratch, chunks after a prefix hit, decodes, an empty sequence, odd
    lengths around the 6- and 12-row tiles and the 32- and 64-key spans."""
    check_mixed_batch(kernel.paged_attention, ("bf16",), head_size, block_size, heads, "bf16 prefill")


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 11, 12, 13, 25])
def test_row_tile_edges(kernel, rows):
    """Query rows (tokens x the group's heads) just below, at and above the tiles."""
    args = make_batch([(rows, rows + 70), (rows, rows)], 4, 4, 64, 16, BF16, gen_for("rows", rows))
    check(kernel.paged_attention, args, what=f"{rows} rows")


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("threads", [1, 2])
def test_default_model_prefill_chunk(kernel, head_major, threads):
    check_default_model_prefill_chunk(kernel.paged_attention, "bf16 ", head_major, threads)


def test_is_deterministic_across_calls_and_threads(kernel):
    check_deterministic_across_calls_and_threads(kernel.paged_attention, "bf16 ")


def test_hands_what_it_cannot_do_to_the_fallback(kernel):
    """Windows, soft caps, sinks, fp32 and head size 80 run the fallback (here the
    reference), not the tiles."""
    check_unsupported_features_run_the_fallback(kernel.paged_attention, "bf16 ")


def test_rejects_bad_block_ids(kernel):
    check_rejects_bad_block_ids(kernel.paged_attention, "bf16 ")
