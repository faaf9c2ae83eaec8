"""Summaries of a simulation: the JSON result, a text table and an optional PNG plot.

Key names follow `pagedserve bench throughput` / `bench serve` where they mean the same
(``tokens_per_s``, ``generated_tokens``, ``elapsed_s``, ``output_tokens_per_s``,
``request_throughput``, ``ttft_s``/``tpot_s`` with ``mean``/``p50``/``p99``,
``preemptions``), so a prediction and a measurement compare key by key.
"""

from __future__ import annotations

import math
import statistics

from pagedserve.entrypoints.cli.bench_serve import percentile
from pagedserve.simulate.simulator import SimResult

__all__ = ["summarize", "format_table", "write_plot"]


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "mean": statistics.fmean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def summarize(result: SimResult) -> dict:
    """The ``"simulated"`` block of ``--json-out``."""
    reqs = result.requests
    gen = sum(r.output_len for r in reqs)
    prompt = sum(r.prompt_len for r in reqs)
    start = min((r.sent for r in reqs), default=0.0)
    elapsed = max(result.elapsed - start, 1e-12)
    usage = [u for _, u, _, _ in result.timeline]
    # time-weighted mean usage: each step's usage holds for that step's duration
    prev, area = start, 0.0
    for t, u, _, _ in result.timeline:
        area += u * (t - prev)
        prev = t
    tpots = [t for r in reqs if (t := r.tpot) is not None]
    return {
        "completed": len(reqs),
        "generated_tokens": gen,
        "prompt_tokens": prompt,
        "elapsed_s": elapsed,
        "tokens_per_s": gen / elapsed,
        "output_tokens_per_s": gen / elapsed,
        "total_tokens_per_s": (gen + prompt) / elapsed,
        "request_throughput": len(reqs) / elapsed,
        "ttft_s": _dist([r.ttft for r in reqs]),
        "tpot_s": _dist(tpots),
        "e2e_s": _dist([r.e2e for r in reqs]),
        "peak_kv_usage": max(usage, default=0.0),
        "mean_kv_usage": area / elapsed,
        "num_preemptions": result.num_preemptions,
        "preemptions": result.num_preemptions,
        "prefix_cache_hit_rate": result.prefix_hits / result.prefix_queries if result.prefix_queries else 0.0,
        "prefix_cache_hit_tokens": result.prefix_hits,
        "num_steps": result.num_steps,
        "num_kv_blocks": result.num_blocks,
        "num_host_kv_blocks": result.num_host_blocks,
        "time_breakdown_s": result.busy_time,
        "kv_usage_timeline": _downsample(result.timeline),
    }


def _downsample(timeline: list[tuple[float, float, int, int]], points: int = 200) -> list[list[float]]:
    """At most ``points`` of ``[time_s, kv_usage, running, waiting]``, evenly spaced in steps."""
    stride = max(1, -(-len(timeline) // points))
    rows = timeline[::stride]
    if timeline and rows[-1] is not timeline[-1]:
        rows.append(timeline[-1])
    return [[round(t, 6), round(u, 5), r, w] for t, u, r, w in rows]


def _ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:9.1f}"


def format_table(s: dict) -> str:
    lines = [
        f"requests           {s['completed']} ({s['prompt_tokens']} prompt + {s['generated_tokens']} output tokens)",
        f"simulated time     {s['elapsed_s']:.3f} s in {s['num_steps']} steps",
        f"throughput         {s['tokens_per_s']:.1f} output tokens/s, {s['total_tokens_per_s']:.1f} total tokens/s, "
        f"{s['request_throughput']:.2f} req/s",
        f"{'latency (ms)':18} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        d = s[key]
        lines.append(f"{label:18} " + " ".join(_ms(d[q]) for q in ("mean", "p50", "p90", "p99", "max")))
    lines += [
        f"KV cache           {s['num_kv_blocks']} blocks; peak usage {s['peak_kv_usage']:.1%}, "
        f"mean {s['mean_kv_usage']:.1%}"
        + (f"; host tier {s['num_host_kv_blocks']} blocks" if s["num_host_kv_blocks"] else ""),
        f"preemptions        {s['num_preemptions']}",
        f"prefix cache       {s['prefix_cache_hit_rate']:.1%} of prompt tokens hit",
    ]
    total = sum(s["time_breakdown_s"].values()) or 1.0
    parts = ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(s["time_breakdown_s"].items(), key=lambda kv: -kv[1]) if v > 0
    )
    lines.append(f"step time          {parts}")
    return "\n".join(lines)


def write_plot(result: SimResult, path: str) -> None:
    """KV usage and queue lengths over time, and the TTFT distribution, as a PNG."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'pagedserve[simulate]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p[0] for p in result.timeline]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(t, [p[1] * 100 for p in result.timeline], label="KV usage %")
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("KV usage (%)")
    ax1.legend(loc="upper left")
    ax1b = ax1.twinx()
    ax1b.plot(t, [p[2] for p in result.timeline], color="tab:green", label="running")
    ax1b.plot(t, [p[3] for p in result.timeline], color="tab:red", label="waiting")
    ax1b.set_ylabel("requests")
    ax1b.legend(loc="upper right")
    ttfts = sorted(r.ttft for r in result.requests)
    ax2.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))])
    ax2.set_xlabel("TTFT (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
