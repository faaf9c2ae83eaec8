"""Where the time of a decode step goes, op by op.

    python benchmarks/profile_decode.py [MODEL] --num-requests 44 --prompt-len 550 [--torch-profiler]

Every op of the engine's registry is wrapped with a wall-clock timer, ``num-requests``
prompts are prefilled, and ``steps`` decode steps are timed after a few warm-up steps;
prints ms per step for each op and the rest (Python, input preparation, sampling).
torch.profiler only sees ops that go through torch's dispatcher: the native CPU kernels
(called through pybind) are invisible to it, so ``--torch-profiler`` (its table for the
same steps) undercounts them.
"""

import argparse
import collections
import random
import time

from pagedserve import LLM, SamplingParams


def time_ops(ops, record, clock=time.perf_counter) -> None:
    """Re-register every op of the registry ``ops`` wrapped in a timer that calls
    ``record(op name, seconds)`` after each call; ``clock`` is the timer (wall clock by
    default; ``time.process_time`` for the process's CPU seconds)."""
    for name in ops.names():
        fn = ops.get(name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = clock()
            try:
                return _fn(*a, **kw)
            finally:
                record(_name, clock() - t0)

        ops.register(name, timed, source=ops.source(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--torch-profiler", action="store_true", help="also print torch.profiler's table")
    args = ap.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=2048,
        max_model_len=max(2048, args.prompt_len + 64),
    )
    eng = llm.llm_engine
    ops = eng.ops
    print("ops:", ", ".join(f"{n}={s}" for n, s in ops.table()))
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def record(name: str, seconds: float) -> None:
        spent[name] += seconds
        calls[name] += 1

    time_ops(ops, record)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.warmup_steps + args.steps + 8, ignore_eos=True)
    for i in range(args.num_requests):
        eng.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()  # prefill
    for _ in range(args.warmup_steps):
        eng.step()
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"\ndecode step, batch {args.num_requests}, context ~{args.prompt_len}: {step_ms:.1f} ms\n")
    print("| op | ms per step | share | calls per step |")
    print("|---|---:|---:|---:|")
    for name, s in spent.most_common():
        ms = s / args.steps * 1e3
        print(f"| {name} | {ms:.2f} | {ms / step_ms:.0%} | {calls[name] // args.steps} |")
    rest = step_ms - sum(spent.values()) / args.steps * 1e3
    print(f"| (everything else) | {rest:.2f} | {rest / step_ms:.0%} | |")
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
