"""Native CPU paged attention alone over bf16, fp8 (scale 1.0), fp8 rows with their scales
and int8 caches, batch 64 decodes over 192 keys (the default model's heads), the caches
interleaved over 15 samples of 30 calls (docs/memory.md).

    python benchmarks/kv_attention_micro.py
"""

from __future__ import annotations

import time

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The CPU platform's storage: each KV head's rows of a block together."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def main() -> None:
    kernels = load_cpu_kernels()
    torch.manual_seed(0)
    batch, ctx, heads, kv_heads, d, bs = 64, 192, 9, 3, 64, 16
    nb = batch * (ctx // bs) + 1
    q = torch.randn(batch, heads, d).bfloat16()
    kv = torch.randn(nb, bs, kv_heads, d)
    tables = torch.randperm(nb - 1)[: batch * (ctx // bs)].view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    caches = {
        "bf16": head_major(kv.bfloat16()),
        "fp8 tensor": head_major(reference.quantize_kv(kv, torch.float8_e4m3fn)),
        "fp8 rows": head_major(reference.quantize_kv_rows(kv, torch.float8_e4m3fn)),
        "int8": head_major(reference.quantize_kv_rows(kv, torch.int8)),
    }
    out = torch.empty_like(q)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(15):
        for name, cache in caches.items():
            t0 = time.perf_counter()
            for _layer in range(30):
                kernels.paged_attention(q, cache, cache, tables, seq_lens, qsl, d**-0.5, out)
            times[name].append(time.perf_counter() - t0)
    base = times["bf16"]
    for name, ts in times.items():
        ratios = sorted(a / b for a, b in zip(ts, base))
        print(
            f"{name:10s} median {sorted(ts)[len(ts) // 2] * 1e3:7.1f} ms per 30 layers; time ratio to bf16 "
            f"median {ratios[len(ratios) // 2]:.2f} (quartiles {ratios[3]:.2f}-{ratios[11]:.2f})"
        )
    print(kernels.isa)


if __name__ == "__main__":
    main()
