"""paged_attention's ``key_ends`` (spans of query tokens attending to each other both
ways: Gemma 3's images): the reference against a dense mask built from the spans as
transformers builds it (causal OR same span, AND the sliding window); the native CPU
kernel (every instruction set runnable here, splits along the keys with 2 threads, a
window with slid-out entries at a NaN block), and the torch SDPA candidate against the
reference (the Triton kernel: test_triton_attention_key_ends.py); malformed key_ends refused."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.platforms.cpu.attention_ops import sdpa_paged_attention
from pagedserve.testing.attention_window_cases import random_key_ends
from tests.kernels.test_cpu_kernels import assert_close, make_batch, num_threads

pytestmark = pytest.mark.timeout(600)

# (q_len, seq_len): a whole prompt, chunks after cached context, decodes, a long chunk.
SEQS = [(23, 23), (1, 37), (20, 90), (40, 170), (1, 1), (16, 64)]


def _dense(q, k, v, spans: list[tuple[int, int]], scale: float, window: int | None) -> torch.Tensor:
    """One whole-prompt sequence [n, heads, d] (kv heads = heads) with a dense mask:
    key j visible to query i when j <= i or both lie in one span, and i - window < j."""
    n = q.shape[0]
    group = torch.full((n,), -1)
    for g, (a, b) in enumerate(spans):
        group[a:b] = g
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    visible = (j <= i) | ((group.view(n, 1) == group.view(1, n)) & (group.view(n, 1) >= 0))
    if window is not None:
        visible &= j > i - window
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v.float())


@pytest.mark.parametrize("window", [None, 3, 40])
def test_reference_is_the_dense_span_mask(window):
    gen = torch.Generator().manual_seed(5 + (window or 0))
    n, heads, d, bs = 30, 2, 16, 4
    q, k, v = (torch.randn(n, heads, d, generator=gen) for _ in range(3))
    spans = [(3, 11), (14, 15), (20, 29)]
    ends = list(range(1, n + 1))
    for a, b in spans:
        ends[a:b] = [b] * (b - a)
    tables = torch.randperm(8, generator=gen)[: (n + bs - 1) // bs].to(torch.int32).view(1, -1)
    kc, vc = torch.randn(8, bs, heads, d, generator=gen), torch.randn(8, bs, heads, d, generator=gen)
    slots = tables[0].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    reference.reshape_and_cache(k, v, kc, vc, slots)
    got = reference.paged_attention(
        q, kc, vc, tables, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
        d**-0.5, sliding_window=window, key_ends=torch.tensor(ends, dtype=torch.int32),
    )  # fmt: skip
    torch.testing.assert_close(got, _dense(q, k, v, spans, d**-0.5, window), atol=1e-5, rtol=1e-5)
    causal = reference.paged_attention(
        q, kc, vc, tables, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
        d**-0.5, sliding_window=window,
    )  # fmt: skip
    assert (got - causal).abs().max() > 1e-3  # the spans change the answer


def _check(every_isa, args, dtype, **extra) -> None:
    scale = args[0].shape[-1] ** -0.5
    want = reference.paged_attention(*args, scale, **extra)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out, **extra) is out
        assert_close(out, want, dtype, f"{isa} {sorted(extra)}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "extra",
    [{}, {"sliding_window": 7}, {"sliding_window": 33, "soft_cap": 4.0}],
    ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()) or "plain",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_kernel(every_isa, threads, extra, dtype):
    gen = torch.Generator().manual_seed(threads * 7 + len(extra))
    args = make_batch(SEQS, 9, 3, 64, 16, dtype, gen)
    ends = random_key_ends(gen, args[4], args[5], 3)
    assert (ends > torch.cat([torch.arange(c - q + 1, c + 1) for q, c in SEQS])).any()
    with num_threads(threads):
        _check(every_isa, args, dtype, key_ends=ends, **extra)


@pytest.mark.parametrize("threads", [1, 2])
def test_native_kernel_long_context_split_along_keys(every_isa, threads):
    """A long prefill chunk after a long context is split along the keys with 2
    threads; a span's keys past the tile's last token fall in the last split."""
    gen = torch.Generator().manual_seed(99)
    args = make_batch([(300, 2500), (1, 2049), (64, 1100)], 9, 3, 64, 16, torch.float32, gen)
    ends = random_key_ends(gen, args[4], args[5], 2)
    with num_threads(threads):
        _check(every_isa, args, torch.float32, key_ends=ends)
        _check(every_isa, args, torch.float32, key_ends=ends, sliding_window=512)


def test_native_kernel_never_reads_slid_out_blocks(every_isa):
    gen = torch.Generator().manual_seed(17)
    q, kc, vc, tables, seq_lens, qsl = make_batch(SEQS, 4, 2, 64, 8, torch.float32, gen)
    ends = random_key_ends(gen, seq_lens, qsl, 2)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sliding_window=9, key_ends=ends)
    owned = {int(b) for i, ctx in enumerate(seq_lens.tolist()) for b in tables[i, : (ctx + 7) // 8]}
    null = next(b for b in range(kc.shape[0]) if b not in owned)  # a spare block no sequence owns
    kc[null], vc[null] = float("nan"), float("nan")
    for i, ctx in enumerate(seq_lens.tolist()):
        q_len = int(qsl[i + 1] - qsl[i])
        tables[i, : max(0, ctx - q_len - 9 + 1) // 8] = null
    assert (tables == null).sum() > 10
    for isa, kernels in every_isa.items():
        got = kernels.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sliding_window=9, key_ends=ends)
        assert_close(got, want, torch.float32, isa)


def test_sdpa_candidate():
    gen = torch.Generator().manual_seed(3)
    args = make_batch(SEQS, 4, 2, 64, 16, torch.float32, gen)
    ends = random_key_ends(gen, args[4], args[5], 2)
    want = reference.paged_attention(*args, 0.125, key_ends=ends)
    torch.testing.assert_close(sdpa_paged_attention(*args, 0.125, key_ends=ends), want, atol=1e-5, rtol=1e-5)


def test_malformed_key_ends_are_refused(every_isa):
    gen = torch.Generator().manual_seed(4)
    args = make_batch([(8, 20)], 4, 2, 64, 16, torch.float32, gen)
    before = torch.arange(13, 21, dtype=torch.int32) - 1  # one short of each token's own position
    past = torch.full((8,), 21, dtype=torch.int32)  # past the sequence's end
    for bad in (before, past):
        with pytest.raises(ValueError, match="key_ends"):
            reference.paged_attention(*args, 0.125, key_ends=bad)
        for kernels in every_isa.values():
            with pytest.raises(ValueError, match="key_ends"):
                kernels.paged_attention(*args, 0.125, key_ends=bad)
    with pytest.raises(ValueError, match="key_ends"):
        reference.paged_attention(*args, 0.125, key_ends=torch.ones(3, dtype=torch.int32))
