"""Load benchmark of a running `pagedserve serve` (Poisson arrivals).

Sends a bounded number of streamed completion requests (token-id prompts of a fixed
length, `ignore_eos`, so every request generates exactly `--output-len` tokens) to a
server on 127.0.0.1, with seeded exponential gaps between arrivals, and reports request
throughput, output tokens/s and the p50/p99 of time to first token (TTFT) and time per
output token (TPOT).  While the load runs it also probes GET /health to measure how
quickly the server's event loop answers while the engine is busy.

The prompts are the ones `pagedserve bench throughput` builds from the same MODEL,
lengths and seed, so the two benchmarks run the same workload.  Prints a summary and one
JSON line prefixed ``RESULT ``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass

__all__ = ["add_arguments", "run", "RequestResult", "percentile"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local model the prompts are drawn for (its vocabulary); default: smollm2-135m-instruct",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--served-model-name", default=None, help="'model' of each request (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=4.0,
        help="mean arrivals per second (Poisson); inf sends everything at once",
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


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def _one(client, url: str, body: dict, headers: dict, timeout: float) -> RequestResult:
    start = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    return RequestResult(True, latency, ttft if ttft is not None else latency, tokens)


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


async def _run_load(args: argparse.Namespace, work, model: str, headers: dict):
    import httpx

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    probes: list[float] = []
    stop = asyncio.Event()

    async def send(prompt: list[int], n_out: int) -> RequestResult:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": n_out,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sem is None:
            return await _one(client, args.url, body, headers, args.timeout)
        async with sem:
            return await _one(client, args.url, body, headers, args.timeout)

    async with httpx.AsyncClient(limits=limits) as client, httpx.AsyncClient() as probe_client:
        prober = (
            asyncio.create_task(_probe(probe_client, args.url, args.probe_interval, stop, probes))
            if args.probe_interval > 0
            else None
        )
        start = time.perf_counter()
        tasks = []
        for prompt, n_out in work:
            tasks.append(asyncio.create_task(send(prompt, n_out)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        stop.set()
        if prober is not None:
            await prober
    return results, elapsed, probes


def _finite(obj):
    """NaN (no samples) as null and infinity (--request-rate inf) as "inf": JSON has neither."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    return obj


def _server_model(url: str, headers: dict) -> str:
    import httpx

    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    from urllib.parse import urlparse

    from pagedserve.entrypoints.bench_throughput import make_workload
    from pagedserve.loader import open_model

    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url must point at this machine (127.0.0.1), got {args.url}")
    key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    vocab = open_model(args.model).hf_config["vocab_size"]
    work = make_workload(args.num_prompts, args.input_len, args.output_len, False, args.seed, vocab)
    model = args.served_model_name or _server_model(args.url, headers)
    results, elapsed, probes = asyncio.run(_run_load(args, work, model, headers))

    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "elapsed_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "output_tokens": out_tokens,
        "ttft_s": {
            "mean": statistics.fmean(ttfts) if ttfts else math.nan,
            "p50": percentile(ttfts, 50),
            "p99": percentile(ttfts, 99),
        },
        "tpot_s": {
            "mean": statistics.fmean(tpots) if tpots else math.nan,
            "p50": percentile(tpots, 50),
            "p99": percentile(tpots, 99),
        },
        "health_probe_s": {
            "count": len(probes),
            "p50": percentile(probes, 50),
            "p99": percentile(probes, 99),
            "max": max(probes) if probes else math.nan,
        },
    }
    print(f"requests:        {len(ok)} ok, {len(results) - len(ok)} failed in {elapsed:.1f} s")
    print(
        f"throughput:      {summary['request_throughput']:.2f} req/s, {summary['output_tokens_per_s']:.1f} "
        "output tokens/s"
    )
    print(f"TTFT:            p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms, p99 {summary['ttft_s']['p99'] * 1e3:.0f} ms")
    print(f"TPOT:            p50 {summary['tpot_s']['p50'] * 1e3:.1f} ms, p99 {summary['tpot_s']['p99'] * 1e3:.1f} ms")
    if probes:
        print(
            f"/health latency: p50 {summary['health_probe_s']['p50'] * 1e3:.1f} ms, p99 "
            f"{summary['health_probe_s']['p99'] * 1e3:.1f} ms, max {summary['health_probe_s']['max'] * 1e3:.1f} ms "
            f"({len(probes)} probes while loaded)"
        )
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}")
            break
    line = json.dumps(_finite(summary))
    print("RESULT " + line)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if ok else 1
