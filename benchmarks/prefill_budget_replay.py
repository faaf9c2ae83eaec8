"""p99 TTFT and ITL of the serving workload per prompt budget, on a priced step clock.

    python benchmarks/prefill_budget_replay.py                       # the step cost fitted idle
    python benchmarks/prefill_budget_replay.py --fit bench_results/serve_trace-<time>/report.json

On a shared machine the same server configuration's p99 latencies move 2-4x between
runs, more than the differences between prompt budgets.  This replays the serving
sweep's workload (the mixed lengths of `bench serve --dataset mixed`, Poisson arrivals,
the seeds given) through pagedserve's real Scheduler and KV-cache manager, one
configuration at a time, with each step priced by the linear cost that
`benchmarks/serve_trace.py` fits to a measured step trace:

    step ms = base + per_prompt_token x prompt tokens + per_decode_row x decode rows

and reports, per budget and rate, p50/p99 TTFT and ITL (every gap between two tokens
of a request; a client sees the same gaps plus its delivery delays, which the step
trace shows are a few ms).  It prices steps only, linearly: no event loop, no attention
growth with context, no batching gain of decode rows (so no saturation rate either); it
ranks budgets, and the served figures come from `serve_sweep.py` / `serve_ab.py`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

from pagedserve.config import SchedulerConfig
from pagedserve.entrypoints.cli.bench_stats import arrival_offsets
from pagedserve.entrypoints.cli.bench_throughput import make_workload
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

#: The default price: the idle GGUF model on 2 cores, a 512-token chunk about 115 ms
#: and a step of a few decode rows 13-20 ms (docs/benchmarks.md).  With no prompt budget
#: it gives the idle sweep's p99s (about 0.39 s TTFT and 110-130 ms ITL at 1 req/s).
DEFAULT_FIT = (8.0, 0.215, 1.5)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def replay(budget: int, threshold: int, rate: float, seed: int, n: int, fit, max_batched: int) -> dict:
    cfg = SchedulerConfig(
        max_num_seqs=256,
        max_num_batched_tokens=max_batched,
        long_prefill_token_threshold=threshold,
        max_prefill_tokens_with_decodes=budget,
    )
    clock = 0.0
    s = Scheduler(cfg, KVCacheManager(8192, 16, enable_prefix_caching=False), 2048, clock=lambda: clock)
    work = make_workload(n, 0, 0, True, seed, 49152)
    arrivals = arrival_offsets(n, rate, random.Random(seed))
    tokens: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    nxt = 0
    base, per_prompt, per_decode = fit
    while nxt < n or s.has_unfinished():
        while nxt < n and arrivals[nxt] <= clock:
            rid = f"r{nxt}"
            prompt, n_out = work[nxt]
            s.add_request(Request(rid, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True)))
            sent[rid], tokens[rid] = arrivals[nxt], []
            nxt += 1
        out = s.schedule()
        if out.empty:
            clock = arrivals[nxt]
            continue
        prompt = sum(
            x.num_new_tokens for x in out.scheduled if x.request.num_computed_tokens < x.request.num_prompt_tokens
        )
        decodes = len(out.scheduled) - sum(
            1 for x in out.scheduled if x.request.num_computed_tokens < x.request.num_prompt_tokens
        )
        clock += (base + per_prompt * prompt + per_decode * decodes) / 1e3
        s.update_after_step(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
        for x in out.scheduled:
            r = x.request
            if x.samples:
                tokens[r.request_id].append(clock)
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    ttft = [tokens[r][0] - sent[r] for r in tokens]
    itl = [b - a for r in tokens for a, b in zip(tokens[r], tokens[r][1:])]
    return {"ttft": ttft, "itl": itl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="0,512,384,320,256,128", help="max_prefill_tokens_with_decodes values")
    p.add_argument("--threshold", type=int, default=512, help="long_prefill_token_threshold")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--request-rates", default="1,1.5,2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seeds", type=int, default=20, help="workload/arrival seeds pooled per cell")
    p.add_argument("--fit", type=pathlib.Path, default=None, help="a serve_trace report.json (its fit)")
    args = p.parse_args(argv)
    fit = DEFAULT_FIT
    if args.fit is not None:
        fit = tuple(json.loads(args.fit.read_text())["fit_ms_base_per_prompt_token_per_decode_row"])
    print(f"step ms = {fit[0]:.2f} + {fit[1]:.4f} x prompt tokens + {fit[2]:.3f} x decode rows")
    print(f"{'budget':>6s} {'rate':>5s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s}")
    for rate in (float(x) for x in args.request_rates.split(",")):
        for budget in (int(x) for x in args.budgets.split(",")):
            ttft, itl = [], []
            for seed in range(args.seeds):
                r = replay(budget, args.threshold, rate, seed, args.num_prompts, fit, args.max_num_batched_tokens)
                ttft += r["ttft"]
                itl += r["itl"]
            print(
                f"{budget:6d} {rate:5g} {_pct(ttft, 50) * 1e3:9.0f} {_pct(ttft, 99) * 1e3:9.0f} "
                f"{_pct(itl, 50) * 1e3:8.1f} {_pct(itl, 99) * 1e3:8.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
