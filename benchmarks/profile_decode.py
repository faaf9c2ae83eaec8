"""Where the time of a decode step goes: torch.profiler over a few engine steps.

    python benchmarks/profile_decode.py --num-requests 64 --prompt-len 128
"""

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from pagedserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory)
    eng = llm.llm_engine
    print("ops:", eng.ops.table())
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.warmup_steps + args.steps + 4, ignore_eos=True)
    for i in range(args.num_requests):
        eng.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    for _ in range(args.warmup_steps):  # prefill, then steady decode
        eng.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    print(f"mean step: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms (profiler on)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
