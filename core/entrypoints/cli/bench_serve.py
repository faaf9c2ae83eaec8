"""Load benchmark of a running server (Poisson arrivals), one rate or a sweep of rates.

Sends a bounded number of streamed completion requests (token-id prompts, `ignore_eos`,
so every request generates exactly its output length) to a server on 127.0.0.1, with
seeded exponential gaps between arrivals, and reports request throughput, output tokens/s
and the p50/p99 of time to first token (TTFT), inter-token latency (ITL), end-to-end
latency and time per output token (TPOT); see `bench_stats` for the definitions and for
the saturation rate that a sweep (`--request-rates 0.5,1,2,4`) reports.  While the load
runs it also probes GET /health to measure how quickly the server answers while busy.

`--backend openai` drives any OpenAI-compatible server (pagedserve, vLLM) through
`/v1/completions`; `--backend llamacpp` drives llama.cpp's `llama-server` through its own
`/completion` endpoint (token-id prompts, `n_predict`, `ignore_eos`, `cache_prompt: false`).

The prompts are the ones `pagedserve bench throughput` builds from the same MODEL,
lengths and seed (`--dataset mixed`: its `--mixed` distribution, 16-1024 prompt and
16-512 output tokens), so the two benchmarks run the same workload.  Prints a summary and
one JSON line prefixed ``RESULT ``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time

from pagedserve.entrypoints.cli.bench_stats import (
    KEEP_UP_FRACTION,
    RequestResult,
    arrival_offsets,
    parse_rates,
    percentile,
    saturation_rate,
    summarize_rate,
)

__all__ = ["add_arguments", "run", "RequestResult", "percentile"]

BACKENDS = ("openai", "llamacpp")


def _rates(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local model the prompts are drawn for (its vocabulary); default: smollm2-135m-instruct",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument(
        "--backend",
        default="openai",
        choices=BACKENDS,
        help="openai: /v1/completions (pagedserve, vLLM); llamacpp: llama-server's /completion",
    )
    p.add_argument("--served-model-name", default=None, help="'model' of each request (default: the server's first)")
    p.add_argument("--dataset", default="fixed", choices=("fixed", "mixed"), help="fixed: --input-len/--output-len")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=4.0,
        help="mean arrivals per second (Poisson); inf sends everything at once",
    )
    p.add_argument(
        "--request-rates",
        type=_rates,
        default=None,
        help="a sweep, e.g. 0.5,1,2,4: one run per rate (same prompts and seed), then the saturation rate",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="bearer key (default: PAGEDSERVE_API_KEY)")
    p.add_argument(
        "--probe-interval",
        type=float,
        default=0.05,
        help="seconds between GET /health probes during the run (0 disables)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")


def _request(backend: str, model: str | None, prompt: list[int], n_out: int) -> tuple[str, dict]:
    """The endpoint and body of one greedy, fixed-length, streamed request."""
    if backend == "llamacpp":
        body = {
            "prompt": prompt,
            "n_predict": n_out,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
        }
        return "/completion", body
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n_out,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return "/v1/completions", body


def _chunk_tokens(backend: str, chunk: dict, seen: int) -> tuple[int, int | None]:
    """(output tokens this chunk carried, the request's final count or None) for one SSE chunk.

    llama-server sends `tokens_predicted` (a running count) in every chunk and `stop: true`
    in the last one, which carries no new token; OpenAI servers send the count only in the
    closing usage chunk, so each of their chunks counts as one token (vLLM sends one per
    token; pagedserve holds back a chunk whose text is still an incomplete character).
    """
    if backend == "llamacpp":
        count = int(chunk.get("tokens_predicted", seen))
        if chunk.get("stop"):
            return 0, count
        return max(1, count - seen), None
    usage = chunk.get("usage")
    return (1 if chunk.get("choices") else 0), (usage["completion_tokens"] if usage else None)


async def _one(client, url: str, backend: str, path: str, body: dict, headers: dict, timeout: float) -> RequestResult:
    res = RequestResult(False, start=time.perf_counter())
    seen, final = 0, None
    try:
        async with client.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                new, count = _chunk_tokens(backend, chunk, seen)
                if new:
                    res.chunk_times.append(time.perf_counter())
                    res.chunk_tokens.append(new)
                    seen += new
                final = count if count is not None else final
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.end = time.perf_counter()
    res.output_tokens = final if final is not None else seen
    res.ok = True
    return res


async def _probe(client, url: str, interval: float, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            await client.get(url + "/health", timeout=30)
            out.append(time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - a missed probe is simply not counted
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def _run_load(args: argparse.Namespace, rate: float, work, model: str | None, headers: dict):
    """Send `work` at `rate`; returns (traces, send times, start time, /health probe latencies)."""
    import httpx

    offsets = arrival_offsets(len(work), rate, random.Random(args.seed))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    probes: list[float] = []
    sends: list[float] = []
    stop = asyncio.Event()

    async def send(prompt: list[int], n_out: int) -> RequestResult:
        path, body = _request(args.backend, model, prompt, n_out)
        if sem is None:
            sends.append(time.perf_counter())
            return await _one(client, args.url, args.backend, path, body, headers, args.timeout)
        async with sem:
            sends.append(time.perf_counter())
            return await _one(client, args.url, args.backend, path, body, headers, args.timeout)

    async with httpx.AsyncClient(limits=limits) as client, httpx.AsyncClient() as probe_client:
        prober = (
            asyncio.create_task(_probe(probe_client, args.url, args.probe_interval, stop, probes))
            if args.probe_interval > 0
            else None
        )
        start = time.perf_counter()
        tasks = []
        for (prompt, n_out), offset in zip(work, offsets):
            # An absolute schedule: sleeping each gap in turn would add up the sleeps' overshoot.
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(prompt, n_out)))
        results = await asyncio.gather(*tasks)
        stop.set()
        if prober is not None:
            await prober
    return results, sends, start, probes


def _finite(obj):
    """NaN (no samples) as null and infinity (--request-rate inf) as "inf": JSON has neither."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    return obj


def _server_model(url: str, headers: dict) -> str:
    import httpx

    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _print_rate(s: dict, probes: list[float]) -> None:
    print(f"requests:        {s['completed']} ok, {s['failed']} failed in {s['elapsed_s']:.1f} s")
    print(f"throughput:      {s['request_throughput']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tokens/s")
    print(f"flow:            offered {s['offered_rate']:.2f} req/s, achieved {s['achieved_rate']:.2f} req/s")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        print(f"{name + ':':17s}p50 {s[key]['p50'] * 1e3:.1f} ms, p99 {s[key]['p99'] * 1e3:.1f} ms")
    if probes:
        print(
            f"/health latency: p50 {percentile(probes, 50) * 1e3:.1f} ms, p99 {percentile(probes, 99) * 1e3:.1f} ms, "
            f"max {max(probes) * 1e3:.1f} ms ({len(probes)} probes while loaded)"
        )


def _print_sweep(rows: list[dict], saturation: float | None) -> None:
    print(
        f"{'rate':>6s} {'offered':>8s} {'achieved':>8s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
        f"{'ITL p50':>8s} {'ITL p99':>8s} {'e2e p50':>8s} {'e2e p99':>8s}  kept up"
    )
    for s in rows:
        ms = [s[k][q] * 1e3 for k in ("ttft_s", "itl_s", "e2e_s") for q in ("p50", "p99")]
        print(
            f"{s['request_rate']:6.2f} {s['offered_rate']:8.2f} {s['achieved_rate']:8.2f} "
            f"{s['output_tokens_per_s']:8.1f} {ms[0]:9.0f} {ms[1]:9.0f} {ms[2]:8.1f} {ms[3]:8.1f} "
            f"{ms[4]:8.0f} {ms[5]:8.0f}  {'yes' if s['keeps_up'] else 'no'}"
        )
    finite = [s["request_rate"] for s in rows if math.isfinite(s["request_rate"])]
    if saturation is None:
        print(f"saturation rate: below {min(finite, default=math.nan):g} req/s (the lowest rate was not kept up with)")
    else:
        more = " (every rate was kept up with: it is at least this)" if saturation == max(finite) else ""
        print(
            f"saturation rate: {saturation:g} req/s{more}: the highest rate whose completions kept within "
            f"{1 - KEEP_UP_FRACTION:.0%} of its arrivals over the second half of the run"
        )


def run(args: argparse.Namespace) -> int:
    from urllib.parse import urlparse

    from pagedserve.entrypoints.cli.bench_throughput import make_workload
    from pagedserve.loader import open_model

    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url must point at this machine (127.0.0.1), got {args.url}")
    rates = args.request_rates or [args.request_rate]
    if args.request_rates and args.num_prompts < 4:
        raise SystemExit("--request-rates needs --num-prompts of at least 4 (see bench_stats: the keep-up measure)")
    key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    vocab = open_model(args.model).hf_config["vocab_size"]
    mixed = args.dataset == "mixed"
    work = make_workload(args.num_prompts, args.input_len, args.output_len, mixed, args.seed, vocab)
    model = None if args.backend == "llamacpp" else (args.served_model_name or _server_model(args.url, headers))
    rows = []
    for rate in rates:
        if len(rates) > 1:
            print(f"--- request rate {rate:g} req/s", flush=True)
        results, sends, t0, probes = asyncio.run(_run_load(args, rate, work, model, headers))
        row = summarize_rate(rate, results, sends, t0)
        row["health_probe_s"] = {
            "count": len(probes),
            "p50": percentile(probes, 50),
            "p99": percentile(probes, 99),
            "max": max(probes) if probes else math.nan,
        }
        _print_rate(row, probes)
        for r in results:
            if not r.ok:
                print(f"failed: {r.error}")
                break
        rows.append(row)
    summary = {
        "workload": {
            "dataset": args.dataset,
            "num_prompts": args.num_prompts,
            "input_len": None if mixed else args.input_len,
            "output_len": None if mixed else args.output_len,
            "prompt_tokens": sum(len(p) for p, _ in work),
            "max_output_tokens": sum(n for _, n in work),
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },
        "backend": args.backend,
        "model": model,
    }
    if args.request_rates:
        summary["rates"] = rows
        summary["keep_up_fraction"] = KEEP_UP_FRACTION
        summary["saturation_rate"] = saturation_rate(rows)
        _print_sweep(rows, summary["saturation_rate"])
    else:
        summary.update(rows[0])
    line = json.dumps(_finite(summary))
    print("RESULT " + line)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if all(r["completed"] for r in rows) else 1
