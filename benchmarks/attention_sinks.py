"""Cost of attention sinks (GPT-OSS) in the native CPU paged-attention kernel: decode
batches of the default model's attention shape (9 query heads, 3 KV heads, head size
64, bf16, block size 16, shuffled block tables) with ``sinks=None`` and with a float32
sink per head, alternating in one process so a busy machine slows both alike.  The
sink is applied once per output row, so the two should time alike; rows without sinks
run the kernel they ran before sinks existed (one branch per output row).

    python benchmarks/attention_sinks.py [--seqs 1 16 64] [--contexts 512 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.kernels.cpu import load_cpu_kernels


def decode_batch(seqs: int, ctx: int, gen: torch.Generator):
    """(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) of
    ``seqs`` decodes over ``ctx`` keys each, blocks scattered through the cache."""
    bs, per_seq = 16, -(-ctx // 16)
    num_blocks = seqs * per_seq + 1
    tables = torch.randperm(num_blocks - 1, generator=gen)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    kc = torch.randn(num_blocks, bs, 3, 64, generator=gen).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, 3, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(seqs, 9, 64, generator=gen).to(torch.bfloat16)
    return q, kc, vc, tables, torch.full((seqs,), ctx, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32)


def time_us(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    sinks = torch.randn(9, generator=gen)
    print(f"kernels: {kernels.source}, threads: {torch.get_num_threads()}")
    print(f"{'seqs':>5} {'ctx':>6} {'no sinks us':>12} {'sinks us':>10} {'ratio':>6}")
    for seqs in args.seqs:
        for ctx in args.contexts:
            batch = decode_batch(seqs, ctx, gen)
            out = torch.empty_like(batch[0])
            iters = max(3, 20000 // (seqs * ctx // 64 + 1))
            plain, sunk = [], []
            for _ in range(args.rounds):
                plain.append(time_us(lambda: kernels.paged_attention(*batch, 0.125, out), iters))
                sunk.append(time_us(lambda: kernels.paged_attention(*batch, 0.125, out, sinks=sinks), iters))
            a, b = statistics.median(plain), statistics.median(sunk)
            print(f"{seqs:>5} {ctx:>6} {a:>12.1f} {b:>10.1f} {b / a:>6.3f}")


if __name__ == "__main__":
    main()
