"""KV-cache efficiency of the paged engine: slot utilisation and prefix-cache TTFT.

    python benchmarks/kv_efficiency.py [MODEL] [--workload mixed] [--prefix-len 1024]

1. **Slot utilisation at steady state.**  The workload (see benchmarks/workloads.py)
   runs through the engine; after every step, over the KV blocks held by running
   requests (shared prefix blocks counted once), the fraction of their slots that hold
   a computed token.  Reported: the token-weighted mean over all steps, over the steps
   of the middle half of the run (steady state), and the minimum.  A system without
   paging reserves max_model_len slots per sequence; its utilisation on the same
   steps is reported beside it.
2. **Time to first token with a cached prefix.**  A request of ``prefix-len`` random
   tokens + 32 distinct tokens runs alone (cold); then requests with the same prefix
   and new suffixes (warm: the prefix's blocks are in the prefix cache).  TTFT is the
   wall time of the engine steps until the first output token, medians of 3.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workloads import make_workload, prepare_model_dir  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402


def slot_utilisation(engine) -> tuple[int, int]:
    """(slots holding computed tokens, slots of the blocks running requests hold)."""
    bs = engine.runner.block_size
    filled: dict[int, int] = {}
    for req in engine.scheduler.running:
        ids = engine.kv.block_ids(req.request_id)
        n = req.num_computed_tokens
        for i, b in enumerate(ids):
            filled[b] = max(filled.get(b, 0), min(bs, max(0, n - i * bs)))
    return sum(filled.values()), len(filled) * bs


def measure_utilisation(llm: LLM, workload, max_model_len: int) -> dict:
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests]
    for i, (r, p) in enumerate(zip(workload.requests, params)):
        engine.add_request(f"u{i}", r.prompt_token_ids, p)
    samples = []
    while engine.has_unfinished_requests():
        engine.step()
        used, held = slot_utilisation(engine)
        if held:
            samples.append((used, held, len(engine.scheduler.running)))
    mid = samples[len(samples) // 4 : 3 * len(samples) // 4]

    def ratio(rows):
        return sum(u for u, _, _ in rows) / sum(h for _, h, _ in rows)

    # Without paging each running sequence reserves max_model_len slots.
    contiguous = sum(u for u, _, _ in samples) / sum(n * max_model_len for _, _, n in samples)
    return {
        "steps": len(samples),
        "mean": ratio(samples),
        "steady_state": ratio(mid),
        "min": min(u / h for u, h, _ in samples),
        "contiguous_reservation": contiguous,
    }


def ttft(llm: LLM, prompt: list[int]) -> float:
    engine = llm.llm_engine
    rid = f"t{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        outs = engine.step()
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="default: the bf16 folder of the comparison scripts")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    args = ap.parse_args(argv)
    model = args.model or str(prepare_model_dir(None))
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=2048,
        kv_cache_memory=args.kv_cache_memory,
        seed=0,
    )
    vocab = llm.llm_engine.arch.vocab_size
    u = measure_utilisation(llm, make_workload(args.workload, vocab, 0, None, None, None), args.max_model_len)
    print(
        f"KV slot utilisation ({args.workload}, block size {llm.llm_engine.runner.block_size}, {u['steps']} steps): "
        f"mean {u['mean']:.4f}, steady state (middle half) {u['steady_state']:.4f}, min {u['min']:.4f}; "
        f"reserving max_model_len={args.max_model_len} per sequence would use {u['contiguous_reservation']:.4f}"
    )
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]

    def suffix() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(32)]

    ttft(llm, [rng.randrange(100, vocab) for _ in range(64)])  # warm-up
    cold = statistics.median(
        ttft(llm, [rng.randrange(100, vocab) for _ in range(args.prefix_len)] + suffix()) for _ in range(3)
    )
    ttft(llm, prefix + suffix())  # puts the prefix in the cache
    warm = statistics.median(ttft(llm, prefix + suffix()) for _ in range(3))
    print(
        f"TTFT, {args.prefix_len}-token prefix + 32 tokens: cold {cold * 1e3:.1f} ms, prefix cached "
        f"{warm * 1e3:.1f} ms: {cold / warm:.1f}x faster"
    )


if __name__ == "__main__":
    main()
