"""Prediction vs measurement: `pagedserve simulate` against a real `bench throughput` run.

Runs the workload of `pagedserve bench throughput` (same prompts: same flags, same seed)
through the real engine on this machine, measuring output tokens/s and per-request time
to first token (TTFT, from the engine's request metrics), then simulates the same flags
on a hardware profile (default: cpu-local, the last `pagedserve simulate calibrate`) and
prints both with the prediction error.

    python -m pagedserve.entrypoints.cli simulate calibrate --threads 1
    python benchmarks/simulate_validate.py --threads 1 --num-prompts 16 --input-len 128 --output-len 32
    python benchmarks/simulate_validate.py --threads 1 --num-prompts 16 --mixed
    python benchmarks/simulate_validate.py --calibrate --threads 1 ...   # both in one run
    python benchmarks/simulate_validate.py --calibrate --threads 1 --timer cpu ...  # on a shared machine
    python benchmarks/simulate_validate.py ... --request-rate 4   # arrivals as bench serve's (no HTTP)
    python benchmarks/simulate_validate.py --model BF16_FOLDER ...  # another model (its format's curve)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from pagedserve.entrypoints.cli.bench_serve import percentile
from pagedserve.entrypoints.cli.bench_throughput import make_workload
from pagedserve.simulate.workload import arrival_times


def measure(args: argparse.Namespace, vocab: int) -> dict:
    """The bench throughput run, stepping the engine here to time each request's first token."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.simulate.calibrate import TIMERS

    clock = TIMERS[args.timer]
    work = make_workload(args.num_prompts, args.input_len, args.output_len, args.mixed, args.seed, vocab)
    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        threads=args.threads,
    )
    llm.generate([work[0][0][:16]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    arrivals = arrival_times(len(work), args.request_rate, 1.0, args.seed)
    t0, w0 = clock(), time.perf_counter()
    idle = 0.0  # time skipped while the engine had nothing to do (the clock may be CPU time)

    def now() -> float:
        return clock() - t0 + idle

    first: dict[str, float] = {}
    gen, nxt = 0, 0
    while nxt < len(work) or engine.has_unfinished_requests():
        while nxt < len(work) and arrivals[nxt] <= now():
            prompt, n = work[nxt]
            engine.add_request(
                f"v{nxt}", None, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), prompt_token_ids=prompt
            )
            nxt += 1
        if not engine.has_unfinished_requests():
            idle += arrivals[nxt] - now()
            continue
        for out in engine.step():
            first.setdefault(out.request_id, now() - arrivals[int(out.request_id[1:])])
            if out.finished:
                gen += len(out.outputs[0].token_ids)
    elapsed, wall = now() - arrivals[0], time.perf_counter() - w0
    ttft = list(first.values())
    return {
        "tokens_per_s": gen / elapsed,
        "elapsed_s": elapsed,
        "wall_s": wall,
        "timer": args.timer,
        "request_rate": args.request_rate,
        "generated_tokens": gen,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "preemptions": engine.scheduler.num_preemptions,
    }


def simulate(args: argparse.Namespace) -> dict:
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.simulate.cli import _simulate
    from pagedserve.simulate.setup import build_plan

    argv = [
        "simulate",
        "--hardware",
        args.hardware,
        *(["--model", args.model] if args.model else []),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--seed",
        str(args.seed),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--request-rate",
        str(args.request_rate),
    ] + (["--mixed"] if args.mixed else [])
    sargs = build_parser(argv).parse_args(argv)
    _, summary = _simulate(build_plan(sargs), sargs)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder or .gguf file (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--mixed", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals (bench serve's seeded draws) fed to the engine in process; default: all "
        "at once (bench throughput)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--hardware", default="cpu-local")
    p.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: time the run (and --calibrate) in process CPU time, for --threads 1 on a shared machine",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate first (into a temporary profile), so that the profile and the measurement "
        "see the same machine load",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.calibrate:
        import tempfile

        from pagedserve.simulate.calibrate import calibrate

        profile = calibrate(None, args.threads, timer=args.timer, model=args.model)
        args.hardware = str(pathlib.Path(tempfile.mkdtemp()) / "cpu-calibrated.json")
        pathlib.Path(args.hardware).write_text(json.dumps(profile.to_dict()))
    sim = simulate(args)  # first: it fails fast on a missing calibration
    from pagedserve.simulate.model_spec import load_model_config

    meas = measure(args, load_model_config(args.model)["vocab_size"])
    rows = [
        ("tokens/s", meas["tokens_per_s"], sim["tokens_per_s"]),
        ("TTFT p50 (s)", meas["ttft_s"]["p50"], sim["ttft_s"]["p50"]),
        ("TTFT p99 (s)", meas["ttft_s"]["p99"], sim["ttft_s"]["p99"]),
    ]
    print(f"{'':14} {'measured':>10} {'predicted':>10} {'error':>8}")
    for name, m, s in rows:
        print(f"{name:14} {m:10.3f} {s:10.3f} {(s - m) / m:+8.1%}")
    result = {
        "measured": meas,
        "simulated": {k: sim[k] for k in ("tokens_per_s", "ttft_s", "preemptions")},
        "errors": {name: (s - m) / m for name, m, s in rows},
        "args": vars(args),
    }
    print("RESULT " + json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
