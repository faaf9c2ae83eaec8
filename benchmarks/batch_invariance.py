"""The trade-off of the CPU GGUF kernel's row-count switch: prefill speed vs batch invariance.

    python benchmarks/batch_invariance.py [--prompts 8] [--prompt-len 64] [--check 8] [--reps 3]

For the default model (Q4_1 blocks, the CPU's native ``gguf_linear``) with the int8 kernel
at every row count (the default, ``CPU_DENSE_MIN_ROWS = None``) and with the dense matmul
from 128 rows up (the former default): prefill tokens/s of one step of ``--prompts``
prompts of ``--prompt-len`` tokens, and how many of ``--check`` greedy answers (16 tokens)
differ between the prompt run alone and run in one batch with all the others.
Prints a markdown table (plus `uptime`, since the machine is shared).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import time

from pagedserve import LLM, SamplingParams
from pagedserve.platforms.cpu import quant_ops

WORDS = "the of and to in is was for on that with as by at from his her they which this are be".split()


def prefill_tps(llm: LLM, prompts: list[list[int]], reps: int) -> float:
    """Prompt tokens/s of one engine step holding every prompt's whole prefill (best of reps)."""
    engine, best = llm.llm_engine, 0.0
    sp = SamplingParams(temperature=0, max_tokens=1)
    for rep in range(reps):
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill-{rep}-{i}-{time.monotonic_ns()}", p, sp)
        start = time.perf_counter()
        engine.step()
        best = max(best, sum(map(len, prompts)) / (time.perf_counter() - start))
        while engine.has_unfinished_requests():
            engine.step()
    return best


def differing(llm: LLM, prompts: list[str], check: int) -> int:
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:check]]
    return sum(a != b for a, b in zip(alone, together))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--check", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="prompts generated together for the check")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM(max_num_batched_tokens=max(2048, args.prompts * args.prompt_len))
    vocab = llm.llm_engine.arch.vocab_size
    ids = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(12, 40))) for _ in range(args.batch)]
    print("| gguf_linear on the CPU | prefill tok/s | greedy answers that differ alone vs batched |")
    print("|---|---|---|")
    for label, rows in (("int8 kernel at every row count (default)", None), ("dense matmul from 128 rows", 128)):
        quant_ops.CPU_DENSE_MIN_ROWS = rows
        tps = prefill_tps(llm, ids, args.reps)
        print(f"| {label} | {tps:.0f} | {differing(llm, texts, args.check)} of {args.check} |", flush=True)
    quant_ops.CPU_DENSE_MIN_ROWS = None
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
