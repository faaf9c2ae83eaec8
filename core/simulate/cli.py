"""`pagedserve simulate`: plan a deployment by running the real scheduler on a simulated clock.

    pagedserve simulate --hardware h100-sxm --model llama3-70b/config.json -tp 4 \\
        --num-prompts 500 --request-rate 8 --json-out plan.json
    pagedserve simulate --hardware h200-sxm --sweep rate=1:64 --slo ttft_p99=0.5
    pagedserve simulate calibrate            # measure this machine -> --hardware cpu-local
    pagedserve simulate calibrate --model ./bf16-folder   # add the bf16 linears to it
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pagedserve.simulate.workload import add_workload_arguments, build_workload

__all__ = ["add_parser", "run", "parse_slo", "parse_sweep"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="capacity planner: predict throughput and latency on given hardware",
        description="Run pagedserve's real scheduler and KV-cache manager on a simulated clock whose steps "
        "are priced by a cost model of the hardware (docs/simulate.md).  `simulate calibrate` "
        "measures this machine.",
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=["calibrate"],
        default=None,
        help="calibrate: measure this machine and write a profile",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face config.json (file or folder) or a .gguf file; default: smollm2-135m-instruct. "
        "calibrate: the model to measure (a checkpoint folder or .gguf file): its weight format's "
        "curve is added to the profile",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="a shipped profile (h100-sxm, h200-sxm, a100-sxm, mi300x, cpu-generic), cpu-local "
        "(the last calibration) or a profile JSON file",
    )
    from pagedserve.simulate.setup import add_engine_arguments

    add_engine_arguments(p)
    add_workload_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--json-out", default=None, help="write the JSON result to this file")
    out.add_argument("--plot", default=None, metavar="PNG", help="plot KV usage and TTFT (needs matplotlib)")
    out.add_argument(
        "--sweep", default=None, metavar="rate=LO:HI", help="find the highest request rate in [LO, HI] meeting --slo"
    )
    out.add_argument(
        "--slo",
        default=None,
        metavar="METRIC=SECONDS[,...]",
        help="e.g. ttft_p99=0.5,tpot_p50=0.05 (metrics ttft/tpot/e2e, quantiles mean/p50/p90/p99)",
    )
    cal = p.add_argument_group("calibrate")
    cal.add_argument("--out", default=None, help="calibrate: profile file (default: the cpu-local location)")
    cal.add_argument("--device", default=None, help="calibrate: platform to measure (default: auto)")
    cal.add_argument("--threads", type=int, default=None, help="calibrate: CPU threads")
    cal.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="calibrate: wall time, or process CPU time (with --threads 1: what an idle machine "
        "would take when this one is shared)",
    )


def parse_slo(text: str) -> dict[str, tuple[str, str, float]]:
    """ "ttft_p99=0.5,tpot_p50=0.05" -> {"ttft_p99": ("ttft_s", "p99"), ...} with limits."""
    out = {}
    for part in text.split(","):
        key, _, val = part.strip().partition("=")
        metric, _, q = key.partition("_")
        if metric not in ("ttft", "tpot", "e2e") or q not in ("mean", "p50", "p90", "p99", "max") or not val:
            raise ValueError(f"--slo {part!r}: expected e.g. ttft_p99=0.5 (ttft/tpot/e2e; mean/p50/p90/p99/max)")
        try:
            limit = float(val)
        except ValueError as e:
            raise ValueError(f"--slo {part!r}: {val!r} is not a number of seconds") from e
        out[key] = (f"{metric}_s", q, limit)
    return out


def parse_sweep(text: str) -> tuple[float, float]:
    key, _, rng = text.partition("=")
    lo, _, hi = rng.partition(":")
    try:
        lo_f, hi_f = float(lo), float(hi)
    except ValueError:
        lo_f = hi_f = -1.0
    if key != "rate" or not 0 < lo_f < hi_f or not math.isfinite(hi_f):
        raise ValueError(f"--sweep {text!r}: expected rate=LO:HI with 0 < LO < HI")
    return lo_f, hi_f


def _meets(summary: dict, slo: dict) -> bool:
    return all(summary[m][q] is not None and summary[m][q] <= lim for m, q, lim in slo.values())


def _simulate(plan, args: argparse.Namespace, rate: float | None = None):
    from pagedserve.simulate.report import summarize

    if rate is not None:
        args = argparse.Namespace(**{**vars(args), "request_rate": rate})
    work = build_workload(args, plan.model.vocab_size, plan.max_model_len)
    if not plan.scheduler.enable_chunked_prefill:
        longest = max(len(r.prompt_token_ids) for r in work)
        if longest > plan.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"a prompt of {longest} tokens exceeds --max-num-batched-tokens "
                f"{plan.scheduler.max_num_batched_tokens} without chunked prefill"
            )
    result = plan.simulator(args.seed).run(work, args.max_concurrency)
    return result, summarize(result)


def _sweep(plan, args: argparse.Namespace, slo: dict) -> dict:
    """Bisect (geometrically) for the highest rate whose simulation meets every SLO."""
    lo, hi = parse_sweep(args.sweep)
    probes = []

    def probe(rate: float) -> bool:
        _, s = _simulate(plan, args, rate)
        ok = _meets(s, slo)
        probes.append(
            {
                "rate": rate,
                "meets_slo": ok,
                "tokens_per_s": s["tokens_per_s"],
                **{k: s[m][q] for k, (m, q, _) in slo.items()},
            }
        )
        print(
            f"  rate {rate:8.3f}/s: "
            + ", ".join(f"{k} {s[m][q]:.3f}s" for k, (m, q, _) in slo.items())
            + f" -> {'meets' if ok else 'misses'} the SLO"
        )
        return ok

    best = None
    if probe(hi):
        best = hi
    elif probe(lo):
        best = lo
        for _ in range(12):
            if hi / lo < 1.02:
                break
            mid = math.sqrt(lo * hi)
            if probe(mid):
                lo = best = mid
            else:
                hi = mid
    return {"best_rate": best, "slo": {k: lim for k, (_, _, lim) in slo.items()}, "probes": probes}


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "calibrate":
            from pagedserve.simulate.calibrate import run_calibration

            return run_calibration(args)
        if args.hardware is None:
            raise ValueError("--hardware is required (a shipped profile, cpu-local or a profile file)")
        return _run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pagedserve.simulate.report import format_table, write_plot
    from pagedserve.simulate.setup import build_plan

    plan = build_plan(args)
    slo = parse_slo(args.slo) if args.slo else None
    if args.sweep and not slo:
        raise ValueError("--sweep needs --slo (e.g. --slo ttft_p99=0.5)")
    result = {
        "model": plan.model.name,
        "hardware": plan.hardware.name,
        "config": plan.describe(),
        "workload": {
            "workload": args.workload or ("mixed" if args.mixed else "fixed"),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },
    }
    if args.sweep:
        print(f"sweeping the request rate for {', '.join(args.slo.split(','))}:")
        result["sweep"] = sweep = _sweep(plan, args, slo)
        if sweep["best_rate"] is None:
            print("no rate in the range meets the SLO")
            final_rate = parse_sweep(args.sweep)[0]
        else:
            print(f"highest rate meeting the SLO: {sweep['best_rate']:.3f} requests/s")
            final_rate = sweep["best_rate"]
        sim, summary = _simulate(plan, args, final_rate)
    else:
        sim, summary = _simulate(plan, args)
        if slo:
            summary["meets_slo"] = _meets(summary, slo)
    result["simulated"] = summary
    print(
        f"{plan.model.name} on {plan.hardware.name} (tp={plan.cost.tp}, pp={plan.cost.pp}, "
        f"{plan.model.weight_format} weights)"
    )
    print(format_table(summary))
    if args.plot:
        write_plot(sim, args.plot)
        print(f"plot written to {args.plot}")
    line = json.dumps(result)
    print("RESULT " + line)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0
