"""The reference paged_attention's sliding window and soft-cap against an independent
dense computation (float64, explicit mask), in prefill chunks and decode; the CPU
platform's op against the reference; gelu_and_mul against transformers' activations."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference


def _dense(q, k, v, ctx: int, scale: float, window: int | None, cap: float | None) -> torch.Tensor:
    """q [q_len, H, D] (the last q_len positions of ctx), k/v [ctx, KVH, D] -> [q_len, H, D]."""
    q_len, heads, _ = q.shape
    group = heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qp = torch.arange(ctx - q_len, ctx)[:, None]
    kp = torch.arange(ctx)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("window,cap", [(1, None), (5, None), (13, None), (None, 2.5), (6, 4.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_window_and_soft_cap_match_dense(window, cap, block_size):
    gen = torch.Generator().manual_seed(window or 0)
    heads, kv_heads, d = 4, 2, 24
    # (context, new tokens): decodes, a chunk after a cached prefix, a whole prompt.
    batch = [(1, 1), (30, 1), (29, 8), (21, 21), (9, 3)]
    per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(sum(n for _, n in batch), heads, d, generator=gen) * 2
    qsl = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, d**-0.5, out, sliding_window=window, soft_cap=cap)
    for i, (ctx, _) in enumerate(batch):
        blocks = tables[i, : per_seq[i]].long()
        k = kc[blocks].reshape(-1, kv_heads, d)[:ctx]
        v = vc[blocks].reshape(-1, kv_heads, d)[:ctx]
        want = _dense(q[qsl[i] : qsl[i + 1]], k, v, ctx, d**-0.5, window, cap)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 7, 16])
def test_reference_never_reads_slid_out_blocks(window):
    """Table entries before first_visible // block_size point at a NaN-filled null block
    (what the KV manager leaves once it frees slid-out blocks): the output stays finite
    and equals the dense computation over the real keys."""
    gen = torch.Generator().manual_seed(40 + window)
    block_size, heads, kv_heads, d = 4, 4, 2, 16
    batch = [(30, 1), (29, 8), (21, 21), (26, 5)]
    per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    num_blocks = sum(per_seq) + 1
    null_block = num_blocks - 1
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.arange(start, start + nb)
        start += nb
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    kc[null_block] = float("nan")
    vc[null_block] = float("nan")
    freed = tables.clone()
    n_freed = 0
    for i, (ctx, q_len) in enumerate(batch):
        first_block = max(0, ctx - q_len - window + 1) // block_size
        freed[i, :first_block] = null_block
        n_freed += first_block
    assert n_freed > 0
    q = torch.randn(sum(n for _, n in batch), heads, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    out = reference.paged_attention(q, kc, vc, freed, seq_lens, qsl, d**-0.5, sliding_window=window)
    assert torch.isfinite(out).all()
    for i, (ctx, _) in enumerate(batch):
        blocks = tables[i, : per_seq[i]].long()
        k = kc[blocks].reshape(-1, kv_heads, d)[:ctx]
        v = vc[blocks].reshape(-1, kv_heads, d)[:ctx]
        want = _dense(q[qsl[i] : qsl[i + 1]], k, v, ctx, d**-0.5, window, None)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_window_changes_the_result_and_rejects_nonsense():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 2, 16, generator=gen)
    kc, vc = torch.randn(2, 8, 1, 16, generator=gen), torch.randn(2, 8, 1, 16, generator=gen)
    args = (
        q,
        kc,
        vc,
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([12], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        0.25,
    )
    full = reference.paged_attention(*args)
    assert not torch.allclose(reference.paged_attention(*args, sliding_window=3), full)
    torch.testing.assert_close(reference.paged_attention(*args, sliding_window=12), full)
    with pytest.raises(ValueError, match="sliding_window"):
        reference.paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        reference.paged_attention(*args, soft_cap=0.0)


def test_cpu_platform_attention_with_window_matches_reference():
    from pagedserve.platforms import select_platform

    _, ops = select_platform("cpu")
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(10, 4, 64, generator=gen)
    kc, vc = torch.randn(4, 16, 2, 64, generator=gen), torch.randn(4, 16, 2, 64, generator=gen)
    args = (
        q,
        kc,
        vc,
        torch.tensor([[2, 0, 3], [1, 0, 0]], dtype=torch.int32),
        torch.tensor([40, 5], dtype=torch.int32),
        torch.tensor([0, 6, 10], dtype=torch.int32),
        0.125,
    )
    for extra in ({"sliding_window": 9}, {"soft_cap": 1.5}, {"sliding_window": 30, "soft_cap": 5.0}):
        torch.testing.assert_close(ops.paged_attention(*args, **extra), reference.paged_attention(*args, **extra))


@pytest.mark.parametrize("act,approximate", [("gelu_pytorch_tanh", "tanh"), ("gelu", "none")])
def test_gelu_and_mul_matches_transformers_activation(act, approximate):
    acts = pytest.importorskip("transformers.activations")
    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3)) * 3
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(reference.gelu_and_mul(x, approximate), acts.ACT2FN[act](gate) * up)
