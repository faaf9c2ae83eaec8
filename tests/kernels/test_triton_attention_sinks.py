"""Attention sinks in the Triton paged-attention kernels against kernels/reference.py
(under TRITON_INTERPRET=1 without a GPU): single pass and split-KV (the sink joins the
reduction once), with a window whose slid-out entries point at a NaN block, soft-cap,
GQA, prefill chunks and decodes, sinks small and dominating."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention  # noqa: E402
from pagedserve.testing.attention_window_cases import point_slid_out_at_nan_block  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(gen: torch.Generator, heads: int, kv_heads: int, d: int, block_size: int, batch):
    per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(sum(n for _, n in batch), heads, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    return q, kc, vc, tables, seq_lens, qsl


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "extra",
    [{}, {"sliding_window": 6}, {"sliding_window": 11, "soft_cap": 3.0}],
    ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()) or "plain",
)
@pytest.mark.parametrize("spread", [1.5, 30.0], ids=["sinks", "large-sinks"])
def test_sinks_match_reference(extra, spread, num_splits):
    gen = torch.Generator().manual_seed(int(spread) * 10 + num_splits)
    q, kc, vc, tables, seq_lens, qsl = _batch(gen, 6, 2, 32, 4, [(1, 1), (40, 1), (29, 8), (21, 21)])
    sinks = torch.randn(6, generator=gen) * spread
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 32**-0.5, sinks=sinks, **extra)
    assert (want - reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 32**-0.5, **extra)).abs().max() > 1e-3
    if "sliding_window" in extra:
        kc, vc, tables, _ = point_slid_out_at_nan_block(kc, vc, tables, seq_lens, qsl, extra["sliding_window"])
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    args = (t.to(DEVICE) for t in (q, kc, vc, tables, seq_lens, qsl))
    got = attention.paged_attention_fixed_splits(*args, 32**-0.5, num_splits, out, sinks=sinks.to(DEVICE), **extra)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


def test_sinks_refuse_a_wrong_shape():
    gen = torch.Generator().manual_seed(1)
    q, kc, vc, tables, seq_lens, qsl = _batch(gen, 4, 2, 16, 4, [(3, 1)])
    with pytest.raises(ValueError, match="sinks"):
        attention.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25, sinks=torch.zeros(3))
