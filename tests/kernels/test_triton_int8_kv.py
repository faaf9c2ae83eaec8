"""The Triton cache write and attention on int8 KV caches against kernels/reference.py.

An int8 cache row is head_size int8 values and then the 4 bytes of its float32 scale
(absmax / 127, computed on write).  The write must store the reference's bytes exactly;
attention must match the reference reading the same cache.  Runs under Triton's
interpreter without a GPU (TRITON_INTERPRET=1, set before triton is imported), tiny
shapes, and on the GPU when there is one.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention, cache  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
NAN_SCALE = torch.tensor([float("nan")]).view(torch.int8)


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_write_stores_the_reference_bytes(dtype, head_major):
    gen = gen_for("write", dtype, head_major)
    blocks, bs, kvh, d, n = 5, 8, 2, 32, 20
    storage = (blocks, kvh, bs, d + 4) if head_major else (blocks, bs, kvh, d + 4)
    init = torch.randint(-128, 128, storage, generator=gen, dtype=torch.int8)
    if head_major:
        init = init.transpose(1, 2)
    key = (torch.randn(n, kvh, d, generator=gen) * 20).to(dtype)
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    key[3, 1] = 0  # a zero row: scale 0
    key[4, 0, 2] = 300.0  # an outlier
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[7] = -1
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    kc, vc = init.clone().to(DEVICE), init.clone().to(DEVICE)
    if head_major:
        kc, vc = kc.as_strided(init.shape, init.stride()), vc.as_strided(init.shape, init.stride())
    cache.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE))
    assert torch.equal(kc.cpu(), want_k)
    assert torch.equal(vc.cpu(), want_v)


def test_triton_write_refuses_rows_without_room_for_the_scale():
    key = torch.randn(2, 1, 32)
    kc = torch.zeros(2, 4, 1, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 cache needs rows of query head_size \\+ 4"):
        cache.reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "seqs,heads,extra,dtype",
    [
        ([(1, 13), (6, 6), (3, 21)], (4, 2), {}, torch.float32),
        ([(1, 13), (3, 21)], (4, 2), {}, torch.float16),
        ([(1, 30), (4, 17)], (4, 1), {"sliding_window": 9}, torch.float32),
        ([(2, 11)], (2, 2), {"soft_cap": 3.0}, torch.float32),
    ],
    ids=["mixed-gqa-fp32", "gqa-fp16", "window", "soft-cap"],
)
def test_triton_attention_reads_int8_caches(seqs, heads, extra, dtype):
    gen = gen_for("attn", repr(seqs), dtype)
    num_heads, kvh = heads
    d, bs = 32, 8
    need = [(ctx + bs - 1) // bs for _, ctx in seqs]
    nb = sum(need) + 2
    kc = reference.quantize_kv_int8(torch.randn(nb, bs, kvh, d, generator=gen) * 3)
    vc = reference.quantize_kv_int8(torch.randn(nb, bs, kvh, d, generator=gen))
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    tables = torch.full((len(seqs), max(need) + 1), int(ids[-1]), dtype=torch.int32)
    kc[int(ids[-1]), ..., d:] = NAN_SCALE  # a block no sequence reads
    vc[int(ids[-1]), ..., d:] = NAN_SCALE
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start : start + n]
        start += n
    if "sliding_window" in extra:  # slid-out entries point at the NaN block
        for i, (q_len, ctx) in enumerate(seqs):
            tables[i, : max(0, ctx - q_len - extra["sliding_window"] + 1) // bs] = int(ids[-1])
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), num_heads, d, generator=gen).to(dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = d**-0.5
    want = reference.paged_attention(query.float(), kc, vc, tables, seq_lens, qsl, scale, **extra)
    assert not want.isnan().any()
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (query, kc, vc, tables, seq_lens, qsl)]
    attention.paged_attention(*dev, scale, out, **extra)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="int8 cache needs rows of query head_size \\+ 4"):
        attention.paged_attention(dev[0], dev[1][..., :d], dev[2][..., :d], *dev[3:], scale)
