"""Attention sinks (GPT-OSS: a learned logit per query head in each softmax's
denominator, no value) in the torch reference and the native CPU kernel: the reference
against a direct softmax over [scores, sink], then the native kernel through every
instruction set against the reference -- with and without a window, with soft-cap,
GQA, prefill chunks, long contexts split along the keys (the sink counted once in the
merge) and sinks large enough to dominate every score."""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedserve.kernels import reference
from tests.kernels.test_cpu_kernels import assert_close, make_batch, num_threads

pytestmark = pytest.mark.timeout(600)

SEQS = [(1, 37), (23, 23), (20, 300), (1, 700), (16, 64), (1, 1), (5, 48), (40, 170)]


def _sinks(heads: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(heads, generator=gen) * spread).float()


def test_reference_matches_softmax_over_scores_and_sink():
    """One sequence, dense math: softmax([q.k * scale (causal), sink]) without the sink's column."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, tables, seq_lens, qsl = make_batch([(9, 9)], 4, 2, 64, 4, torch.float32, gen)
    sinks = _sinks(4, 2.0, gen)
    got = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sinks=sinks)
    k = kc[tables[0, :3].long()].reshape(-1, 2, 64)[:9].repeat_interleave(2, dim=1)
    v = vc[tables[0, :3].long()].reshape(-1, 2, 64)[:9].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.125
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([scores, sinks.view(4, 1, 1).expand(4, 9, 1)], dim=-1).softmax(-1)[..., :-1]
    want = torch.einsum("hqk,khd->qhd", full, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125)
    assert (got - plain).abs().max() > 1e-2  # the sink changes the answer
    with pytest.raises(ValueError, match="sinks"):
        reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sinks=sinks[:3])


def check(every_isa, args, dtype, **extra) -> None:
    scale = args[0].shape[-1] ** -0.5
    expected = reference.paged_attention(*args, scale, **extra)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out, **extra) is out
        assert_close(out, expected, dtype, f"{isa} {sorted(extra)}")


@pytest.mark.parametrize(
    "extra",
    [{}, {"sliding_window": 7}, {"soft_cap": 2.5}, {"sliding_window": 19, "soft_cap": 4.0}],
    ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()) or "plain",
)
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["sinks", "large-sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
def test_sinks_mixed_batch(every_isa, extra, spread, dtype, heads):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((extra, spread, dtype, heads)).encode()))
    args = make_batch(SEQS, heads[0], heads[1], 64, 16, dtype, gen)
    check(every_isa, args, dtype, sinks=_sinks(heads[0], spread, gen), **extra)


@pytest.mark.parametrize("head_size", [80, 128])
def test_sinks_head_sizes(every_isa, head_size):
    gen = torch.Generator().manual_seed(head_size)
    args = make_batch(SEQS, 8, 2, head_size, 16, torch.bfloat16, gen, head_major=True)
    check(every_isa, args, torch.bfloat16, sinks=_sinks(8, 3.0, gen), sliding_window=24)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "seqs", [[(1, 2048)], [(300, 2500)], [(1, 2049), (1, 5), (64, 1100)]], ids=["long-decode", "long-chunk", "mixed"]
)
def test_sinks_long_contexts_split_along_keys(every_isa, threads, seqs):
    """Split contexts merge (max, sum, acc) partials: the sink must join only the merged sum."""
    gen = torch.Generator().manual_seed(threads)
    args = make_batch(seqs, 9, 3, 64, 16, torch.float32, gen)
    with num_threads(threads):
        check(every_isa, args, torch.float32, sinks=_sinks(9, 2.0, gen))
        check(every_isa, args, torch.float32, sinks=_sinks(9, 30.0, gen), sliding_window=700)


def test_sinks_run_natively_and_refuse_bad_shapes(every_isa, monkeypatch):
    from pagedserve.kernels.cpu import native

    gen = torch.Generator().manual_seed(29)
    args = make_batch(SEQS, 4, 2, 64, 16, torch.float32, gen)
    sinks = _sinks(4, 2.0, gen)
    expected = reference.paged_attention(*args, 0.125, sinks=sinks)

    def refuse(*_a, **_k):
        raise AssertionError("the native kernel fell back to the reference")

    monkeypatch.setattr(native.reference, "paged_attention", refuse)
    for isa, kernels in every_isa.items():
        torch.testing.assert_close(kernels.paged_attention(*args, 0.125, sinks=sinks), expected, msg=isa)
        with pytest.raises(ValueError, match="sinks"):
            kernels.paged_attention(*args, 0.125, sinks=sinks[:2])
