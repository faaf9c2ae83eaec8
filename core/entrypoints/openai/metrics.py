"""Prometheus metrics of the server, named like vLLM's (``pagedserve:`` for ``vllm:``).

Engine-wide values (queue lengths, KV-cache usage, token and prefix-cache counters) are
read from the engine's statistics snapshot at scrape time by a custom collector, so the
engine thread never touches prometheus objects; per-request latencies are observed as
histograms when a request finishes.  Everything lives in a registry of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine import EngineStats
from pagedserve.outputs import RequestOutput

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """Gauges and counters straight from `EngineStats` at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(self._labels, value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._gauge("pagedserve:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._gauge("pagedserve:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._gauge("pagedserve:kv_cache_usage_perc",
                          "Fraction of KV-cache blocks referenced by requests (1 = full).", s.kv_cache_usage)
        yield self._counter("pagedserve:prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield self._counter("pagedserve:prefix_cache_hits",
                            "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield self._counter("pagedserve:num_preemptions", "Requests preempted (recomputed later).",
                            s.num_preemptions)
        yield self._counter("pagedserve:prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens)
        yield self._counter("pagedserve:generation_tokens", "Tokens generated.", s.generation_tokens)


class ServerMetrics:
    """The server's registry: engine collector plus request latency histograms."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, one observation per request.",
                              labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("pagedserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record the latencies of a finished request (called on the event loop)."""
        m = out.metrics
        arrival, first, last = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
        name = self.model_name
        if arrival is not None and first is not None:
            self.ttft.labels(name).observe(max(first - arrival, 0.0))
        if arrival is not None and last is not None:
            self.e2e.labels(name).observe(max(last - arrival, 0.0))
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if first is not None and last is not None and tokens > 1:
            self.tpot.labels(name).observe(max(last - first, 0.0) / (tokens - 1))
        for c in out.outputs:
            self.success.labels(name, c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
