"""Latency statistics of `pagedserve bench serve`: per-request traces, per-rate summaries, saturation.

A request's trace is its send time, the arrival time of every streamed chunk that carried
output tokens, and its end. From it:

    TTFT   first chunk - send
    ITL    gaps between consecutive chunks of one request, pooled over all requests of a
           rate (as vLLM's serving benchmark counts them); a chunk known to carry k tokens
           (llama-server reports its running count) gives k samples of gap / k
    e2e    end - send
    TPOT   (e2e - TTFT) / (output tokens - 1)

A rate is *kept up with* when, once the run has filled up, requests complete about as fast
as they arrive: over the second half of the arrivals (from the send of request n/2 to the
last send, window length w),

    offered  = (arrivals in the window - 1) / w       (the sampled Poisson rate)
    achieved = completions in the window / w

and achieved >= `KEEP_UP_FRACTION` x offered.  This is flow balance: a server that keeps
up completes each request some bounded latency after it came, so the backlog at both ends
of the window is about the same; a saturated one falls behind and its backlog grows.  The
window ends at the last arrival, so the drain of the last requests after it (which any
finite run has) does not count as falling behind, and it starts half-way, so filling an
empty server does not count either; it also catches a continuous-batching server that
admits everything and then finishes it all together at the end.  The saturation rate is
the highest finite rate of a sweep that was kept up with, along with every lower rate,
and with no failed request.  Use enough requests per rate that a request's latency is
well under half the run (the measure needs at least 4).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = [
    "KEEP_UP_FRACTION",
    "RequestResult",
    "arrival_offsets",
    "flow_rates",
    "parse_rates",
    "percentile",
    "saturation_rate",
    "summarize_rate",
]

KEEP_UP_FRACTION = 0.9


@dataclass
class RequestResult:
    """One request's trace; times are `time.perf_counter()` seconds.

    `chunk_times` holds the arrival of every streamed chunk that carried output tokens and
    `chunk_tokens` how many each carried, where the server says (empty: one each).
    """

    ok: bool
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def itls(self) -> list[float]:
        counts = self.chunk_tokens or [1] * len(self.chunk_times)
        out = []
        for a, b, k in zip(self.chunk_times, self.chunk_times[1:], counts[1:]):
            out += [(b - a) / k] * k
        return out

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


def parse_rates(text: str) -> list[float]:
    """`"0.5,1,2,inf"` -> `[0.5, 1.0, 2.0, inf]`: positive, strictly increasing request rates."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise ValueError(f"request rates must be comma-separated numbers, got {text!r}") from e
    if not rates:
        raise ValueError("no request rate given")
    if any(not r > 0 for r in rates):  # also catches nan
        raise ValueError(f"request rates must be positive, got {text!r}")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"request rates must be strictly increasing, got {text!r}")
    return rates


def arrival_offsets(n: int, rate: float, rng) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent (Poisson at `rate`).

    The first request goes at 0 and each later one after an exponential gap drawn from
    `rng` (a `random.Random`) in order, so a seed gives the same schedule to every server;
    an infinite rate sends everything at once.
    """
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return offsets


def flow_rates(send_times: list[float], end_times: list[float]) -> tuple[float, float]:
    """(offered, achieved) request rates over the second half of the arrivals; nan when undefined."""
    sends = sorted(send_times)
    if len(sends) < 4:
        return math.nan, math.nan
    lo, hi = sends[len(sends) // 2], sends[-1]
    if hi <= lo:
        return math.nan, math.nan
    arrivals = sum(lo <= t <= hi for t in sends) - 1  # gaps, so that k evenly spaced arrivals give their rate
    done = sum(lo <= t <= hi for t in end_times)
    return arrivals / (hi - lo), done / (hi - lo)


def _dist(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
    }


def summarize_rate(rate: float, results: list[RequestResult], send_times: list[float], t0: float) -> dict:
    """One rate's summary: latency percentiles, throughput, offered and achieved request rates.

    Args:
        rate: the requested mean arrival rate (req/s; may be inf).
        results: every request's trace, failed ones included.
        send_times: when each request was actually sent (perf_counter seconds).
        t0: when the run started; throughput is counted from it to the last completion.
    """
    ok = [r for r in results if r.ok]
    ends = [r.end for r in ok]
    elapsed = (max(ends) - t0) if ends else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    offered, achieved = flow_rates(send_times, ends)
    # nan (too few requests, or all sent at once) compares False: such a run proves nothing.
    keeps_up = math.isfinite(rate) and len(ok) == len(results) and achieved >= KEEP_UP_FRACTION * offered
    return {
        "request_rate": rate,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "elapsed_s": elapsed,
        "request_throughput": len(ok) / elapsed if ok else 0.0,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed if ok else 0.0,
        "offered_rate": offered,
        "achieved_rate": achieved,
        "keeps_up": keeps_up,
        "ttft_s": _dist([r.ttft for r in ok]),
        "itl_s": _dist([g for r in ok for g in r.itls]),
        "e2e_s": _dist([r.latency for r in ok]),
        "tpot_s": _dist([t for r in ok if (t := r.tpot) is not None]),
    }


def saturation_rate(summaries: list[dict]) -> float | None:
    """The highest finite rate kept up with, along with every lower one; None if the lowest was not.

    `summaries` are `summarize_rate` results in increasing rate order.
    """
    best = None
    for s in summaries:
        if not s["keeps_up"]:
            break
        best = s["request_rate"]
    return best
