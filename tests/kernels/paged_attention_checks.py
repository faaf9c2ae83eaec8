"""What the tests of the CPU's tiled paged-attention kernels (AMX, AVX-512 BF16 prefill)
share: their inputs, the comparison with kernels/reference.py (float32 copies of the
inputs, the output poisoned with NaN first), and the checks each kernel goes through.
``tag`` starts each check's input seeds, so that two kernels see inputs of their own."""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedserve.kernels import reference
from tests.kernels.test_cpu_kernels import assert_close, make_batch, num_threads

BF16 = torch.bfloat16
# Prefills from scratch, chunks after a prefix hit (the queries are the last q_len
# positions), decodes, a sequence with no query tokens, odd lengths around the 16-row
# tiles and the 32- and 64-key spans.
MIXED = [(1, 37), (23, 23), (20, 300), (1, 700), (16, 64), (0, 40), (5, 48), (64, 65), (33, 97), (130, 130)]


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def check(fn, args, dtype=BF16, what: str = "") -> None:
    scale = args[0].shape[-1] ** -0.5
    # The reference on float32 copies: the kernel's bf16 products are exact in float32.
    expected = reference.paged_attention(*(a.float() if a.is_floating_point() else a for a in args), scale)
    out = torch.full_like(args[0], float("nan"))
    got = fn(*args, scale, out)
    assert got is out
    assert_close(got, expected, dtype, what)


def load_or_skip(unavailable_reason, load, what: str, isa: str):
    """The kernel ``load()`` gives where the CPU has ``isa``; elsewhere the test is skipped
    with ``unavailable_reason()``.  A CPU that has it and a kernel that did not build or
    load is a failure."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no {what} here: {reason}")
    kernel = load()
    if kernel is None:
        pytest.fail(f"the CPU has {isa} but the {what} kernel did not build or load (see the warning)")
    return kernel


def over_mixed_batch_shapes(test):
    """Parametrizes ``test`` over head sizes, block sizes and head groupings (MHA, GQA, MQA)."""
    heads = [(4, 4), (9, 3), (8, 2), (16, 1)]
    test = pytest.mark.parametrize("heads", heads, ids=["mha", "gqa3", "gqa4", "mqa16"])(test)
    test = pytest.mark.parametrize("block_size", [16, 32, 8])(test)
    return pytest.mark.parametrize("head_size", [64, 96, 128, 256])(test)


def check_mixed_batch(fn, key: tuple, head_size: int, block_size: int, heads, what: str) -> None:
    """MIXED (prefills, chunks after a prefix hit, decodes, an empty sequence) at one shape;
    ``key`` starts the inputs' seed."""
    args = make_batch(MIXED, *heads, head_size, block_size, BF16, gen_for(*key, head_size, block_size, heads))
    check(fn, args, what=f"{what} d={head_size} bs={block_size} heads={heads}")


def check_default_model_prefill_chunk(fn, tag: str, head_major: bool, threads: int) -> None:
    """The default model's shapes: a 512-token chunk after 512 cached tokens, beside decodes."""
    args = make_batch(
        [(512, 1024), (1, 200), (3, 129)],
        9,
        3,
        64,
        16,
        BF16,
        gen_for(tag + "chunk", head_major, threads),
        head_major=head_major,
    )
    with num_threads(threads):
        check(fn, args, what=tag + "chunk")


def check_deterministic_across_calls_and_threads(fn, tag: str) -> None:
    """Reused packing buffers never leak one call's keys into the next."""
    big = make_batch([(40, 900), (7, 300)], 9, 3, 64, 16, BF16, gen_for(tag + "big"))
    small = make_batch([(9, 20)], 9, 3, 64, 16, BF16, gen_for(tag + "small"))
    first = fn(*small, 0.125)
    fn(*big, 0.125)
    with num_threads(1):
        again = fn(*small, 0.125)
    torch.testing.assert_close(first, again, atol=0, rtol=0)


def check_unsupported_features_run_the_fallback(fn, tag: str) -> None:
    """Windows, soft caps, sinks, fp32 and head size 80 run the fallback (the reference
    here), not the tiles."""
    args = make_batch([(6, 40), (1, 9)], 8, 2, 64, 16, BF16, gen_for(tag + "features"))
    scale = 0.125
    for kwargs in ({"sliding_window": 7}, {"soft_cap": 5.0}, {"sinks": torch.randn(8)}):
        expected = reference.paged_attention(*args, scale, **kwargs)
        torch.testing.assert_close(fn(*args, scale, **kwargs), expected)
    args80 = make_batch([(6, 40)], 8, 2, 80, 16, BF16, gen_for(tag + "d80"))
    check(fn, args80, what="d=80")
    fp32 = make_batch([(6, 40)], 8, 2, 64, 16, torch.float32, gen_for(tag + "fp32"))
    check(fn, fp32, torch.float32, "fp32")


def check_rejects_bad_block_ids(fn, tag: str) -> None:
    q, k, v, bt, sl, qsl = make_batch([(4, 40)], 4, 4, 64, 16, BF16, gen_for(tag + "bad"))
    bt[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        fn(q, k, v, bt, sl, qsl, 0.125)
