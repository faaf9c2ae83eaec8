"""Inputs and the reference of the 8-bit KV cache op tests: the five cache kinds (int8
rows, fp8 rows with their scales, unscaled fp8), random paged batches over them, and the
reference attention on the dequantized float32 cache."""

from __future__ import annotations

import zlib

import torch

from pagedserve.kernels import reference
from tests.kernels.test_cpu_kernels import make_batch

# (kind id, cache dtype, row-scaled): a row-scaled row is head_size values then the 4
# bytes of its float32 scale; an unscaled fp8 row holds the values cast at scale 1.0.
KINDS = [
    ("int8", torch.int8, True),
    ("e4m3-rows", torch.float8_e4m3fn, True),
    ("e5m2-rows", torch.float8_e5m2, True),
    ("e4m3", torch.float8_e4m3fn, False),
    ("e5m2", torch.float8_e5m2, False),
]
KIND_IDS = [k[0] for k in KINDS]
# (q_len, seq_len): decodes, a whole prompt, prefix-cache continuations, block edges.
SEQS = [(1, 37), (23, 23), (20, 150), (1, 300), (16, 64), (1, 1), (5, 48)]


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def quantized_rows(x: torch.Tensor, kind) -> torch.Tensor:
    """The reference's bytes of ``kind`` for rows ``x [..., d]``."""
    _, kv, scaled = kind
    return reference.quantize_kv_rows(x, kv) if scaled else reference.quantize_kv(x, kv)


def quantized_cache(values: torch.Tensor, kind, head_major: bool = True) -> torch.Tensor:
    """``values [blocks, block_size, kv_heads, d]`` -> a ``kind`` cache (head-major storage
    like the CPU platform's, or token-major)."""
    nb, bs, kvh, _ = values.shape
    rows = quantized_rows(values, kind)
    kv = kind[1]
    if head_major:
        cache = torch.empty(nb, kvh, bs, rows.shape[-1], dtype=kv).transpose(1, 2)
    else:
        cache = torch.empty(nb, bs, kvh, rows.shape[-1], dtype=kv)
    cache.view(torch.uint8).copy_(rows.view(torch.uint8))
    return cache


def kv8_batch(seqs, heads, head_size, kind, gen, block_size=16, dtype=torch.bfloat16, head_major=True, key_scale=4.0):
    """make_batch's inputs with ``kind`` caches (keys spread wider than values, an outlier
    channel in some rows, as a model's are) and every block no sequence reads given NaN
    scales (row-scaled) or NaN values (unscaled)."""
    _, kv, scaled = kind
    q, kc, vc, tables, seq_lens, qsl = make_batch(seqs, *heads, head_size, block_size, torch.float32, gen)
    kc = kc * key_scale
    kc[::3, :, :, 0] *= 8.0  # an outlier channel: it grows its own row's scale only
    kc, vc = quantized_cache(kc, kind, head_major), quantized_cache(vc, kind, head_major)
    owned = set()
    for i, ctx in enumerate(seq_lens.tolist()):
        owned.update(tables[i, : (ctx + block_size - 1) // block_size].tolist())
    nan = torch.tensor([float("nan")]).view(kv)
    for b in range(kc.shape[0]):
        if b not in owned:
            if scaled:
                kc[b, ..., head_size:] = nan
                vc[b, ..., head_size:] = nan
            else:
                kc[b].view(torch.uint8).fill_(0x7F)  # NaN in both formats
                vc[b].view(torch.uint8).fill_(0x7F)
    return q.to(dtype), kc, vc, tables, seq_lens, qsl


def dequantized(cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The float32 values of a cache of any kind."""
    if cache.shape[-1] == head_size:
        return cache.float()
    return reference.dequantize_kv(cache, head_size)


def expected_attention(args, **extra) -> torch.Tensor:
    """The reference on float32 copies of everything (the caches dequantized)."""
    q, kc, vc, *meta = args
    d = q.shape[-1]
    return reference.paged_attention(q.float(), dequantized(kc, d), dequantized(vc, d), *meta, d**-0.5, **extra)
