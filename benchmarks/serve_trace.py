"""What sets a loaded server's p99 inter-token latency: client gaps joined with a step trace.

    python benchmarks/serve_trace.py --request-rate 1 --num-prompts 32
    python benchmarks/serve_trace.py --request-rate 1.5 --flags "--max-prefill-tokens-with-decodes 0"
    python benchmarks/serve_trace.py --analyze bench_results/serve_trace-<time>   # again, from the files

Starts `pagedserve serve` (the settings of serve_sweep.py: default GGUF model, 2048-token
budget, no prefix caching; `--flags` adds serve flags) with PAGEDSERVE_STEP_TRACE set
(core/engine/step_trace.py), sends the mixed workload of `pagedserve bench serve --dataset mixed`
with Poisson arrivals, and records when every streamed chunk arrived.  Then, for each
inter-token gap, it finds the engine step that produced the chunk's token (the request's
last step before the chunk arrived) and splits the gap into

- ``step``: that step's own length (scheduling, forward, output processing), with its
  prompt tokens (how many, for how many requests) and decode rows;
- ``between``: the engine thread's time between the previous token's step and this one
  (draining the request queue, publishing outputs, and any step that skipped the request);
- ``lag``: from the step's end to the chunk's arrival at the client (event-loop wake-up,
  SSE formatting and writing, the client's own parsing), minus the previous token's lag.

It prints the top 1% of gaps so attributed, what they have in common, a least-squares
fit of step length on prompt tokens and decode rows (the cost that a per-step prompt
budget trades), and the event-loop hand-over delays.  Files go to
bench_results/serve_trace-<time>/ (trace.jsonl, client.json, report.json).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import json
import os
import pathlib
import random
import statistics
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
SETTINGS = {"max_model_len": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 2048, "kv_cache_memory": "4GiB"}


async def _one(client, url: str, rid: str, prompt: list[int], n_out: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0.0, "ignore_eos": True, "stream": True}
    body["request_id"] = rid  # the engine's id becomes cmpl-<rid>: the trace's name for it
    rec = {"id": f"cmpl-{rid}", "prompt": len(prompt), "out": n_out, "send": time.perf_counter(), "chunks": []}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                rec["chunks"].append(time.perf_counter())
    return rec


async def _load(url: str, work: list[tuple[list[int], int]], rate: float, seed: int) -> list[dict]:
    import httpx

    from pagedserve.entrypoints.cli.bench_stats import arrival_offsets

    offsets = arrival_offsets(len(work), rate, random.Random(seed))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        start, tasks = time.perf_counter(), []
        for i, ((prompt, n_out), offset) in enumerate(zip(work, offsets)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, f"t{i}", prompt, n_out)))
        return await asyncio.gather(*tasks)


def _benchmark_helpers():
    """serve_sweep's warm-up and servers' process handling (imported late: the analysis
    alone, as the tests load it, needs no benchmarks/ on sys.path)."""
    sys.path.insert(0, str(_HERE))
    import serve_sweep
    import servers

    return serve_sweep.warm_up, servers.ServerProcess, servers.free_port, servers.pagedserve_cmd


def run_server(args, out: pathlib.Path) -> None:
    from pagedserve.entrypoints.cli.bench_throughput import make_workload
    from pagedserve.loader import open_model

    warm_up, ServerProcess, free_port, pagedserve_cmd = _benchmark_helpers()

    port = free_port()
    cmd = pagedserve_cmd(args.python, str(args.gguf), port, args.threads, {**SETTINGS, "seed": args.seed}, None)
    cmd += args.flags.split()
    trace = out / "trace.jsonl"
    vocab = open_model(str(args.gguf)).hf_config["vocab_size"]
    work = make_workload(args.num_prompts, 0, 0, True, args.seed, vocab)
    with ServerProcess("pagedserve", cmd, port, out / "server.log", {"PAGEDSERVE_STEP_TRACE": str(trace)}) as srv:
        warm_up(srv.url, "openai")
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        requests = asyncio.run(_load(srv.url, work, args.request_rate, args.seed))
    meta = {"rate": args.request_rate, "flags": args.flags, "load_at_start": load, "t0": t0, "threads": args.threads}
    (out / "client.json").write_text(json.dumps({"meta": meta, "requests": requests}))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _fit(steps: list[dict]) -> tuple[float, float, float]:
    """Least squares: step ms = a + b * prompt tokens + c * decode rows."""
    import numpy as np

    x = np.array([[1.0, sum(s["prefill"].values()), len(s["decode"])] for s in steps])
    y = np.array([(s["t_end"] - s["t0"]) * 1e3 for s in steps])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return tuple(float(c) for c in coef)


def attribute(steps: list[dict], requests: list[dict]) -> list[dict]:
    """One row per inter-token gap: the gap, its producing step and the split described above."""
    producing: dict[str, list[dict]] = {}
    for s in steps:
        for rid in s["decode"] + s["first"]:
            producing.setdefault(rid, []).append(s)
    gaps = []
    for req in requests:
        mine = producing.get(req["id"], [])
        ends = [s["t_end"] for s in mine]
        prev_step, prev_lag = None, None
        for j, c in enumerate(req["chunks"]):
            k = bisect.bisect_right(ends, c) - 1
            if k < 0:
                continue
            step, lag = mine[k], c - mine[k]["t_end"]
            if j > 0 and prev_step is not None:
                gap = c - req["chunks"][j - 1]
                span = [s for s in steps if prev_step["t_end"] < s["t_end"] <= step["t_end"]]
                prompt = sum(sum(s["prefill"].values()) for s in span)
                gaps.append(
                    {
                        "id": req["id"],
                        "gap_ms": gap * 1e3,
                        "step_ms": (step["t_end"] - step["t0"]) * 1e3,
                        "fwd_ms": (step["t_fwd"] - step["t_sched"]) * 1e3,
                        "post_ms": (step["t_end"] - step["t_fwd"]) * 1e3,
                        "between_ms": (step["t0"] - prev_step["t_end"]) * 1e3,
                        "lag_ms": lag * 1e3,
                        "lag_change_ms": (lag - prev_lag) * 1e3,
                        "steps": len(span),
                        "step_prompt_tokens": sum(step["prefill"].values()),
                        "step_prefills": len(step["prefill"]),
                        "span_prompt_tokens": prompt,
                        "decode_rows": len(step["decode"]),
                    }
                )
            prev_step, prev_lag = step, lag
    return gaps


def attribute_ttft(steps: list[dict], requests: list[dict]) -> list[dict]:
    """Per request, its TTFT split into the wait for its first step, its prompt's steps
    (how many, and how many prompt tokens of other requests they computed) and delivery."""
    rows = []
    for req in requests:
        rid = req["id"]
        mine = [s for s in steps if rid in s["prefill"]]
        if not req["chunks"] or not mine:
            continue
        first, last = mine[0], mine[-1]
        during = [s for s in steps if first["t0"] <= s["t0"] <= last["t0"]]
        rows.append(
            {
                "id": rid,
                "prompt": req["prompt"],
                "ttft_ms": (req["chunks"][0] - req["send"]) * 1e3,
                "wait_ms": (first["t0"] - req["send"]) * 1e3,
                "prefill_ms": (last["t_end"] - first["t0"]) * 1e3,
                "delivery_ms": (req["chunks"][0] - last["t_end"]) * 1e3,
                "prompt_steps": len(mine),
                "others_prompt_tokens": sum(sum(v for k, v in s["prefill"].items() if k != rid) for s in during),
            }
        )
    return sorted(rows, key=lambda r: -r["ttft_ms"])


def _summarize(gaps: list[dict], steps: list[dict], dispatches: list[dict]) -> dict:
    itl = [g["gap_ms"] for g in gaps]
    p99 = _pct(itl, 99)
    top = sorted((g for g in gaps if g["gap_ms"] >= p99), key=lambda g: -g["gap_ms"])
    rest = [g for g in gaps if g["gap_ms"] < p99]

    def mean(rows, key):
        return statistics.fmean(r[key] for r in rows) if rows else float("nan")

    keys = ("gap_ms", "step_ms", "fwd_ms", "post_ms", "between_ms", "lag_ms", "lag_change_ms", "steps")
    keys += ("step_prompt_tokens", "step_prefills", "span_prompt_tokens", "decode_rows")
    with_prompt = [s for s in steps if s["prefill"]]
    pure = [s for s in steps if not s["prefill"]]
    hand = [(d["t_loop"] - d["t_post"]) * 1e3 for d in dispatches]
    route = [(d["t_done"] - d["t_loop"]) * 1e3 for d in dispatches]
    return {
        "gaps": len(gaps),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p99_ms": p99,
        "top": {k: mean(top, k) for k in keys},
        "rest": {k: mean(rest, k) for k in keys},
        "top_with_prompt_in_step": sum(g["step_prompt_tokens"] > 0 for g in top),
        "top_with_several_prefills": sum(g["step_prefills"] > 1 for g in top),
        "top_count": len(top),
        "steps": len(steps),
        "steps_with_prompt": len(with_prompt),
        "step_ms_p50_p99_pure_decode": [_pct([(s["t_end"] - s["t0"]) * 1e3 for s in pure], q) for q in (50, 99)],
        "step_ms_p50_p99_with_prompt": [_pct([(s["t_end"] - s["t0"]) * 1e3 for s in with_prompt], q) for q in (50, 99)],
        "fit_ms_base_per_prompt_token_per_decode_row": _fit(steps) if len(steps) > 3 else None,
        "loop_handover_ms_p50_p99_max": [_pct(hand, 50), _pct(hand, 99), max(hand, default=float("nan"))],
        "loop_route_ms_p50_p99_max": [_pct(route, 50), _pct(route, 99), max(route, default=float("nan"))],
        "lag_ms_p50_p99_max": [_pct([g["lag_ms"] for g in gaps], q) for q in (50, 99, 100)],
        "between_ms_p50_p99_max": [_pct([g["between_ms"] for g in gaps if g["steps"] == 1], q) for q in (50, 99, 100)],
        "top_gaps": top[:40],
    }


def analyze(out: pathlib.Path) -> dict:
    client = json.loads((out / "client.json").read_text())
    t0 = client["meta"]["t0"]
    steps, dispatches = [], []
    with open(out / "trace.jsonl", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("t0", rec.get("t_post", 0.0)) < t0:
                continue  # the warm-up request
            (steps if rec["ev"] == "step" else dispatches).append(rec)
    report = _summarize(attribute(steps, client["requests"]), steps, dispatches)
    ttft = [r["chunks"][0] - r["send"] for r in client["requests"] if r["chunks"]]
    report["ttft_ms_p50_p99"] = [_pct(ttft, 50) * 1e3, _pct(ttft, 99) * 1e3]
    report["slowest_ttft"] = attribute_ttft(steps, client["requests"])[:5]
    report["meta"] = client["meta"]
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def print_report(r: dict) -> None:
    m = r["meta"]
    print(f"rate {m['rate']} req/s, flags {m['flags']!r}, load at start {m['load_at_start']:.1f}")
    print(f"{r['gaps']} gaps: ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms")
    print("TTFT p50 / p99: {:.0f} / {:.0f} ms".format(*r["ttft_ms_p50_p99"]))
    print(f"steps: {r['steps']}, {r['steps_with_prompt']} with prompt tokens")
    print("step ms p50/p99, decodes only: {:.1f} / {:.1f}".format(*r["step_ms_p50_p99_pure_decode"]))
    print("step ms p50/p99, with prompt tokens: {:.1f} / {:.1f}".format(*r["step_ms_p50_p99_with_prompt"]))
    if r["fit_ms_base_per_prompt_token_per_decode_row"]:
        a, b, c = r["fit_ms_base_per_prompt_token_per_decode_row"]
        print(f"fit: step ms = {a:.2f} + {b:.4f} x prompt tokens + {c:.3f} x decode rows")
    print("event-loop hand-over ms p50/p99/max: {:.2f} / {:.2f} / {:.2f}".format(*r["loop_handover_ms_p50_p99_max"]))
    print("routing to streams ms p50/p99/max: {:.2f} / {:.2f} / {:.2f}".format(*r["loop_route_ms_p50_p99_max"]))
    print("step end to client ms p50/p99/max: {:.2f} / {:.2f} / {:.2f}".format(*r["lag_ms_p50_p99_max"]))
    print("engine between steps ms p50/p99/max: {:.2f} / {:.2f} / {:.2f}".format(*r["between_ms_p50_p99_max"]))
    print(
        f"top 1% ({r['top_count']} gaps): {r['top_with_prompt_in_step']} produced by a step with prompt tokens, "
        f"{r['top_with_several_prefills']} by a step with several prefills"
    )
    print(f"{'':>6s} " + " ".join(f"{k[:12]:>12s}" for k in r["top"]))
    for name in ("top", "rest"):
        print(f"{name:>6s} " + " ".join(f"{v:12.1f}" for v in r[name].values()))
    print("slowest first tokens:")
    for t in r.get("slowest_ttft", []):
        print(
            f"  {t['ttft_ms']:7.1f} ms ({t['prompt']} prompt tokens) = wait {t['wait_ms']:6.1f} + prompt "
            f"{t['prefill_ms']:6.1f} in {t['prompt_steps']} steps (beside {t['others_prompt_tokens']} prompt "
            f"tokens of others) + delivery {t['delivery_ms']:.1f}"
        )
    print("largest gaps:")
    for g in r["top_gaps"][:15]:
        print(
            f"  {g['gap_ms']:7.1f} ms = step {g['step_ms']:6.1f} (prompt {g['step_prompt_tokens']:4d} tok in "
            f"{g['step_prefills']} req, {g['decode_rows']} decodes) + between {g['between_ms']:6.1f} "
            f"+ lag change {g['lag_change_ms']:6.1f} (lag {g['lag_ms']:.1f}; {g['steps']} steps)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--flags", default="", help="extra `pagedserve serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--python", default=sys.executable, help="the Python that runs pagedserve")
    p.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the default model's GGUF file")
    p.add_argument("--analyze", type=pathlib.Path, default=None, help="a directory of an earlier run: report only")
    args = p.parse_args(argv)
    if args.analyze is None:
        if args.gguf is None:
            sys.path.insert(0, str(_HERE))
            from workloads import default_gguf_path

            args.gguf = default_gguf_path()
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = _HERE.parent / "bench_results" / f"serve_trace-{stamp}"
        out.mkdir(parents=True, exist_ok=True)
        run_server(args, out)
    else:
        out = args.analyze
    print_report(analyze(out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
