"""The native CPU paged_attention's sliding window and soft-cap against the torch
reference, through every instruction set compiled in and runnable here: windows shorter
than the prompt, prefill chunks, decodes, mixed batches, GQA, soft-cap with and without
a window, long contexts split along the keys, and slid-out block-table entries that
point at a NaN-filled block (or at no valid block at all), which must never be read."""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import NativeCpuKernels
from tests.kernels.test_cpu_kernels import assert_close, make_batch, num_threads

pytestmark = pytest.mark.timeout(600)


# (q_len, seq_len): decodes short and long, a whole prompt, chunks after a prefix,
# block-aligned edges and a one-token sequence.
SEQS = [(1, 37), (23, 23), (20, 300), (1, 700), (16, 64), (1, 1), (5, 48), (40, 170)]


def check(every_isa: dict[str, NativeCpuKernels], args, dtype: torch.dtype, **extra) -> None:
    scale = args[0].shape[-1] ** -0.5
    expected = reference.paged_attention(*args, scale, **extra)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out, **extra) is out
        assert_close(out, expected, dtype, f"{isa} {extra}")


@pytest.mark.parametrize(
    "extra",
    [
        {"sliding_window": 1},
        {"sliding_window": 7},
        {"sliding_window": 33},
        {"sliding_window": 256},
        {"soft_cap": 2.5},
        {"sliding_window": 19, "soft_cap": 4.0},
    ],
    ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
def test_window_and_soft_cap_mixed_batch(every_isa, extra, dtype, block_size, heads):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((extra, dtype, block_size, heads)).encode()))
    args = make_batch(SEQS, heads[0], heads[1], 64, block_size, dtype, gen)
    check(every_isa, args, dtype, **extra)


@pytest.mark.parametrize("head_size", [80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_window_and_soft_cap_head_sizes(every_isa, head_size, dtype):
    gen = torch.Generator().manual_seed(head_size)
    args = make_batch(SEQS, 8, 2, head_size, 16, dtype, gen, head_major=True)
    check(every_isa, args, dtype, sliding_window=24, soft_cap=20.0)


@pytest.mark.parametrize("block_size", [1, 8, 128])
def test_window_odd_block_sizes(every_isa, block_size):
    gen = torch.Generator().manual_seed(block_size + 100)
    args = make_batch(SEQS, 14, 2, 64, block_size, torch.bfloat16, gen)
    check(every_isa, args, torch.bfloat16, sliding_window=13)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "seqs",
    [[(1, 2048)], [(300, 2500)], [(1, 2049), (1, 5), (64, 1100)]],
    ids=["long-decode", "long-prefill-chunk", "mixed"],
)
def test_window_long_contexts_split_along_keys(every_isa, threads, seqs):
    """With 2 threads long contexts are split along the keys (from the window's first
    block on) and merged; a split may hold no key some of its tokens see."""
    gen = torch.Generator().manual_seed(threads)
    args = make_batch(seqs, 9, 3, 64, 16, torch.float32, gen)
    with num_threads(threads):
        check(every_isa, args, torch.float32, sliding_window=512)
        check(every_isa, args, torch.float32, sliding_window=700, soft_cap=30.0)


def _free_slid_out(args, window: int, null_id: int) -> int:
    """Points every table entry before each sequence's first visible block at null_id,
    as the KV manager does once it frees them; returns how many it rewrote."""
    _, key_cache, _, tables, seq_lens, qsl = args
    block_size = key_cache.shape[1]
    freed = 0
    for i, ctx in enumerate(seq_lens.tolist()):
        q_len = int(qsl[i + 1] - qsl[i])
        first_block = max(0, ctx - q_len - window + 1) // block_size
        tables[i, :first_block] = null_id
        freed += first_block
    return freed


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slid_out_entries_pointing_at_a_nan_block_are_never_read(every_isa, threads, dtype):
    gen = torch.Generator().manual_seed(17)
    q, kc, vc, tables, seq_lens, qsl = make_batch([*SEQS, (1, 2000)], 9, 3, 64, 16, dtype, gen)
    expected = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sliding_window=40)
    null = kc.shape[0] - 1  # a spare block no sequence owns
    kc[null] = float("nan")
    vc[null] = float("nan")
    assert _free_slid_out((q, kc, vc, tables, seq_lens, qsl), 40, null) > 100
    with num_threads(threads):
        for isa, kernels in every_isa.items():
            out = torch.full_like(q, float("nan"))
            kernels.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, out, sliding_window=40)
            assert_close(out, expected, dtype, isa)


def test_slid_out_entries_may_hold_any_id(every_isa):
    """Entries that are never read are not validated either (only the visible ones)."""
    gen = torch.Generator().manual_seed(23)
    args = make_batch([(1, 300), (8, 90)], 4, 2, 64, 16, torch.float32, gen)
    expected = reference.paged_attention(*args, 0.125, sliding_window=30)
    _free_slid_out(args, 30, -7)
    for isa, kernels in every_isa.items():
        torch.testing.assert_close(kernels.paged_attention(*args, 0.125, sliding_window=30), expected, msg=isa)
    args[3][0, -1 + (300 + 15) // 16] = 10_000  # a visible entry out of range is still refused
    for kernels in every_isa.values():
        with pytest.raises(ValueError, match="block id"):
            kernels.paged_attention(*args, 0.125, sliding_window=30)


def test_window_and_cap_run_natively_and_refuse_nonsense(every_isa, monkeypatch):
    """No fallback: with the reference made unusable the native kernel still answers."""
    from pagedserve.kernels.cpu import native

    gen = torch.Generator().manual_seed(29)
    args = make_batch(SEQS, 4, 2, 64, 16, torch.float32, gen)
    expected = reference.paged_attention(*args, 0.125, sliding_window=9, soft_cap=3.0)

    def refuse(*_a, **_k):
        raise AssertionError("the native kernel fell back to the reference")

    monkeypatch.setattr(native.reference, "paged_attention", refuse)
    for isa, kernels in every_isa.items():
        got = kernels.paged_attention(*args, 0.125, sliding_window=9, soft_cap=3.0)
        torch.testing.assert_close(got, expected, msg=isa)
        with pytest.raises(ValueError, match="sliding_window"):
            kernels.paged_attention(*args, 0.125, sliding_window=0)
        with pytest.raises(ValueError, match="soft_cap"):
            kernels.paged_attention(*args, 0.125, soft_cap=0.0)
