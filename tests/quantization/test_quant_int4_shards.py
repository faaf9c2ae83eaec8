"""GPTQ and AWQ weights split for tensor parallelism in their packed form: a
column-parallel shard (output channels, zero channels for padding indices) and a
row-parallel shard (input columns: whole packed words for GPTQ, whole groups for AWQ)
dequantize to exactly the slices of the whole weight."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quantization.int4 import AWQWeight, GPTQWeight

N, K, GROUP = 48, 128, 32


def _random_words(shape, gen) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _gptq(gen) -> GPTQWeight:
    g_idx = torch.randint(0, K // GROUP, (K,), generator=gen, dtype=torch.int32)  # act order: any group
    scales = (torch.rand(K // GROUP, N, generator=gen) + 0.5).half()
    return GPTQWeight(_random_words((K // 8, N), gen), _random_words((K // GROUP, N // 8), gen), scales, g_idx)


def _awq(gen) -> AWQWeight:
    scales = (torch.rand(K // GROUP, N, generator=gen) + 0.5).half()
    return AWQWeight(_random_words((K, N // 8), gen), _random_words((K // GROUP, N // 8), gen), scales, GROUP)


@pytest.mark.parametrize("make", [_gptq, _awq], ids=["gptq", "awq"])
def test_shards_dequantize_to_the_slices_of_the_whole(make):
    gen = torch.Generator().manual_seed(5)
    w = make(gen)
    full = w.dequantize()
    assert full.shape == (N, K) and full.abs().sum() > 0
    # A column-parallel shard in any order, with two padding rows (zero channels).
    rows = torch.cat([torch.randperm(N, generator=gen)[:14], torch.tensor([N, N])])
    part = w.select_rows(rows)
    assert type(part) is type(w) and part.qweight.dtype == torch.int32
    want = torch.cat([full, full.new_zeros(1, K)])[rows]
    torch.testing.assert_close(part.dequantize(), want, rtol=0, atol=0)
    # Row-parallel shards: whole words (GPTQ) or whole groups (AWQ); others are refused (None).
    for start, stop in ((0, 64), (64, 128), (32, 96)):
        cols = w.select_columns(start, stop)
        torch.testing.assert_close(cols.dequantize(), full[:, start:stop], rtol=0, atol=0)
    assert w.select_columns(4, 68) is None
    with pytest.raises(NotImplementedError):
        w.select_rows(torch.arange(5))  # not whole packed words of output channels
    # Both at once, as the loader applies them.
    both = w.select_rows(rows).select_columns(32, 96)
    torch.testing.assert_close(both.dequantize(), want[:, 32:96], rtol=0, atol=0)
