"""Prometheus metrics of the server, named like vLLM's (``pagedserve:`` for ``vllm:``).

Engine-wide values (queue lengths, KV-cache usage, token and prefix-cache counters, and
the host KV tier's usage, spills, reloads and swaps) are read from the engine's
statistics snapshot at scrape time by a custom collector, so the engine thread never
touches prometheus objects; per-request latencies are observed as histograms when a
request finishes.  Everything lives in a registry of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine import EngineStats
from pagedserve.outputs import RequestOutput
from pagedserve.spec_decode.metrics import spec_decode_metrics

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST", "ReplicaCollector"]

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
        yield self._counter("pagedserve:num_preemptions",
                            "Requests preempted (swapped out to the host KV tier, or recomputed later).",
                            s.num_preemptions)
        yield self._counter("pagedserve:prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens)
        yield self._counter("pagedserve:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield from self._host_tier(s)
        yield from spec_decode_metrics(s, self._labels[0])

    def _host_tier(self, s: EngineStats) -> Iterator[Metric]:
        """The host KV tier (kv_offload_memory; all zero without one)."""
        yield self._gauge("pagedserve:host_kv_cache_blocks", "KV blocks in the host tier.", s.host_kv_cache_blocks)
        yield self._gauge("pagedserve:host_kv_cache_usage_perc",
                          "Fraction of host-tier blocks referenced (swapped-out requests, pending copies).",
                          s.host_kv_cache_usage)
        yield self._gauge("pagedserve:host_kv_cache_cached_blocks",
                          "Host-tier blocks holding a prefix-cache block.", s.host_kv_cache_cached_blocks)
        yield self._counter("pagedserve:host_prefix_cache_hits",
                            "Prompt tokens found in the host tier (included in prefix_cache_hits).",
                            s.host_prefix_cache_hits)
        yield self._counter("pagedserve:kv_blocks_spilled_to_host",
                            "Evicted device KV blocks copied to the host tier.", s.kv_blocks_spilled)
        yield self._counter("pagedserve:kv_spills_dropped",
                            "Evicted device KV blocks not spilled because no host block was free.",
                            s.kv_spills_dropped)
        yield self._counter("pagedserve:kv_blocks_reloaded_from_host",
                            "Host-tier KV blocks copied back to the device for prefix-cache hits.",
                            s.kv_blocks_reloaded)
        yield self._counter("pagedserve:num_swap_outs", "Requests preempted by swapping their KV to host.",
                            s.num_swap_outs)
        yield self._counter("pagedserve:num_swap_ins", "Swapped-out requests whose KV was copied back.",
                            s.num_swap_ins)
        yield self._counter("pagedserve:kv_blocks_swapped_out", "KV blocks copied to host by swap-outs.",
                            s.kv_blocks_swapped_out)
        yield self._counter("pagedserve:kv_blocks_swapped_in", "KV blocks copied back by swap-ins.",
                            s.kv_blocks_swapped_in)


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


class ReplicaCollector(Collector):
    """Per data-parallel replica (label ``replica``), read at scrape time from ``status()``:
    a list of objects with ``index, platform, alive, routed, affinity_routed`` and
    ``stats`` (the replica's last `EngineStats`).  The engine-wide series above are the
    sums over replicas; these show how the router spreads the load."""

    def __init__(self, status: Callable[[], list], model_name: str) -> None:
        self._status = status
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        families = {
            "up": GaugeMetricFamily("pagedserve:dp_replica_up", "1 while the replica serves, 0 once it exited.",
                                    labels=[*labels, "platform"]),
            "running": GaugeMetricFamily("pagedserve:dp_replica_num_requests_running",
                                         "Sequences in the replica's running batch.", labels=labels),
            "waiting": GaugeMetricFamily("pagedserve:dp_replica_num_requests_waiting",
                                         "Sequences waiting in the replica's queue.", labels=labels),
            "kv": GaugeMetricFamily("pagedserve:dp_replica_kv_cache_usage_perc",
                                    "Fraction of the replica's KV-cache blocks in use.", labels=labels),
            "routed": CounterMetricFamily("pagedserve:dp_replica_requests_routed",
                                          "Requests the router sent to the replica.", labels=labels),
            "affinity": CounterMetricFamily("pagedserve:dp_replica_requests_affinity_routed",
                                            "Requests sent to the replica for its cached prompt prefix.",
                                            labels=labels),
            "hits": CounterMetricFamily("pagedserve:dp_replica_prefix_cache_hits",
                                        "Prompt tokens found in the replica's prefix cache.", labels=labels),
            "queries": CounterMetricFamily("pagedserve:dp_replica_prefix_cache_queries",
                                           "Prompt tokens looked up in the replica's prefix cache.", labels=labels),
        }
        for r in self._status():
            key = [self._model, str(r.index)]
            s = r.stats
            families["up"].add_metric([*key, r.platform], 1.0 if r.alive else 0.0)
            families["running"].add_metric(key, s.num_running if r.alive else 0)
            families["waiting"].add_metric(key, s.num_waiting if r.alive else 0)
            families["kv"].add_metric(key, s.kv_cache_usage if r.alive else 0.0)
            families["routed"].add_metric(key, r.routed)
            families["affinity"].add_metric(key, r.affinity_routed)
            families["hits"].add_metric(key, s.prefix_cache_hits)
            families["queries"].add_metric(key, s.prefix_cache_queries)
        yield from families.values()
