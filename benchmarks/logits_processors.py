"""Cost of the per-request logit edits (logit_bias, allowed_token_ids, bad_words) in the
sampler, against the same batch without them, at the default model's vocabulary.

    python benchmarks/logits_processors.py [--rows 1 16 64 256] [--vocab 49152] [--repeat 20] [--threads 1]

Each row of a batch uses all three edits (10 biased ids, 100 allowed ids, 4 bad words of
1-2 tokens): the worst case.  Prints milliseconds per sampler call and the added time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.executor.sampler import Sampler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

__all__ = ["bench", "main"]


def _requests(rows: int, vocab: int, edits: bool, gen: torch.Generator) -> list[Request]:
    out = []
    for i in range(rows):
        kw = dict(temperature=0.8, seed=i)
        if edits:
            ids = torch.randint(0, vocab, (110,), generator=gen).tolist()
            kw.update(logit_bias={t: 2.0 for t in ids[:10]}, allowed_token_ids=ids[10:], bad_words=["x"])
        p = SamplingParams(**kw)
        if edits:
            p._bad_words_token_ids = [[ids[0]], [ids[1], ids[2]], [ids[3]], [ids[4], ids[5]]]
        r = Request(f"r{i}", [1, 2, 3], p)
        r.append_token(ids[1] if edits else 7)
        out.append(r)
    return out


def bench(rows: int, vocab: int, repeat: int) -> tuple[float, float]:
    """(ms per call without edits, ms per call with them)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    result = []
    for edits in (False, True):
        requests = _requests(rows, vocab, edits, gen)
        sampler = Sampler()
        sampler(logits, requests)  # warm-up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            sampler(logits, requests)
            times.append(time.perf_counter() - t0)
        result.append(statistics.median(times) * 1e3)
    return result[0], result[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'rows':>5} {'plain ms':>9} {'edits ms':>9} {'added ms':>9}")
    for rows in args.rows:
        plain, edited = bench(rows, args.vocab, args.repeat)
        print(f"{rows:>5} {plain:>9.2f} {edited:>9.2f} {edited - plain:>9.2f}")


if __name__ == "__main__":
    main()
