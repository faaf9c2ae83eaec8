"""Prometheus metrics of the server, named like vLLM's (``pagedserve:`` for ``vllm:``).

Engine-wide values (queue lengths, KV-cache usage, token and prefix-cache counters, and
the host KV tier's usage, spills, reloads and swaps) are read from the engine's
statistics snapshot at scrape time by a custom collector, so the engine thread never
touches prometheus objects; per-request latencies are observed as histograms from the
engine's timestamps (arrival, first scheduled step, first and latest token) as outputs
arrive.  Everything lives in a registry of its own; ``prefix="vllm"`` names every series
as vLLM does, so dashboards written for vLLM work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine import ITERATION_TOKEN_BUCKETS, EngineStats
from pagedserve.outputs import RequestOutput
from pagedserve.spec_decode.metrics import spec_decode_metrics

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST", "ReplicaCollector", "INTERNAL_REQUEST_PREFIX", "token_buckets"]

# vLLM's buckets, so that dashboards' quantile queries read the same.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

#: Labels of every series: the model and the engine index (vLLM's ``engine``).
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"
#: Requests the server makes itself (the readiness probe) stay out of the request metrics.
INTERNAL_REQUEST_PREFIX = "pagedserve-internal-"


class _EngineCollector(Collector):
    """Gauges and counters straight from `EngineStats` at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prefix: str = "pagedserve") -> None:
        self._stats = stats
        self._labels = [model_name, ENGINE_INDEX]
        self._prefix = prefix

    def _name(self, name: str) -> str:
        return name.replace("pagedserve:", f"{self._prefix}:", 1)

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(self._name(name), doc, labels=LABELS)
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(self._name(name), doc, labels=LABELS)
        c.add_metric(self._labels, value)
        return c

    def _iterations(self, s: EngineStats) -> Metric:
        """Steps by tokens scheduled (vLLM's iteration_tokens_total histogram)."""
        h = HistogramMetricFamily(
            self._name("pagedserve:iteration_tokens_total"), "Tokens scheduled per engine step.", labels=LABELS
        )
        counts = s.iteration_tokens_buckets or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        h.add_metric(self._labels, list(zip(bounds, counts)), s.iteration_tokens_sum)
        return h

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._gauge("pagedserve:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._gauge("pagedserve:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._gauge(
            "pagedserve:kv_cache_usage_perc",
            "Fraction of KV-cache blocks referenced by requests (1 = full).",
            s.kv_cache_usage,
        )
        yield self._counter(
            "pagedserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield self._counter(
            "pagedserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield self._counter(
            "pagedserve:num_preemptions",
            "Requests preempted (swapped out to the host KV tier, or recomputed later).",
            s.num_preemptions,
        )
        yield self._counter("pagedserve:prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens)
        yield self._counter("pagedserve:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield self._iterations(s)
        yield from self._host_tier(s)
        yield from spec_decode_metrics(s, self._labels[0], self._labels[1], self._prefix)

    def _host_tier(self, s: EngineStats) -> Iterator[Metric]:
        """The host KV tier (kv_offload_memory; all zero without one)."""
        yield self._gauge("pagedserve:host_kv_cache_blocks", "KV blocks in the host tier.", s.host_kv_cache_blocks)
        yield self._gauge(
            "pagedserve:host_kv_cache_usage_perc",
            "Fraction of host-tier blocks referenced (swapped-out requests, pending copies).",
            s.host_kv_cache_usage,
        )
        yield self._gauge(
            "pagedserve:host_kv_cache_cached_blocks",
            "Host-tier blocks holding a prefix-cache block.",
            s.host_kv_cache_cached_blocks,
        )
        yield self._counter(
            "pagedserve:host_prefix_cache_hits",
            "Prompt tokens found in the host tier (included in prefix_cache_hits).",
            s.host_prefix_cache_hits,
        )
        yield self._counter(
            "pagedserve:kv_blocks_spilled_to_host",
            "Evicted device KV blocks copied to the host tier.",
            s.kv_blocks_spilled,
        )
        yield self._counter(
            "pagedserve:kv_spills_dropped",
            "Evicted device KV blocks not spilled because no host block was free.",
            s.kv_spills_dropped,
        )
        yield self._counter(
            "pagedserve:kv_blocks_reloaded_from_host",
            "Host-tier KV blocks copied back to the device for prefix-cache hits.",
            s.kv_blocks_reloaded,
        )
        yield self._counter(
            "pagedserve:num_swap_outs", "Requests preempted by swapping their KV to host.", s.num_swap_outs
        )
        yield self._counter("pagedserve:num_swap_ins", "Swapped-out requests whose KV was copied back.", s.num_swap_ins)
        yield self._counter(
            "pagedserve:kv_blocks_swapped_out", "KV blocks copied to host by swap-outs.", s.kv_blocks_swapped_out
        )
        yield self._counter(
            "pagedserve:kv_blocks_swapped_in", "KV blocks copied back by swap-ins.", s.kv_blocks_swapped_in
        )
        yield self._counter(
            "pagedserve:kv_connector_blocks_loaded",
            "Prefix KV blocks loaded from the KV connector's store instead of computed.",
            s.kv_connector_blocks_loaded,
        )
        yield self._counter(
            "pagedserve:kv_connector_blocks_saved",
            "Full KV blocks saved to the KV connector's store.",
            s.kv_connector_blocks_saved,
        )


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context window (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > max_model_len:
                return out
            out.append(value)
        exp += 1


class ServerMetrics:
    """The server's registry: the engine collector plus per-request histograms.

    Args:
        stats: returns the engine's latest `EngineStats` snapshot.
        model_name: the ``model_name`` label.
        max_model_len: the largest token-count bucket.
        prefix: metric name prefix (``pagedserve``; ``vllm`` for vLLM's dashboards).
        cache_info: labels of ``cache_config_info`` (block size, block count, ...).
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        max_model_len: int = 2048,
        prefix: str = "pagedserve",
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        self._labels = (model_name, ENGINE_INDEX)
        self.registry.register(_EngineCollector(stats, model_name, prefix))
        if cache_info:
            info = {"model_name": model_name, "engine": ENGINE_INDEX, **cache_info}
            self.registry.register(
                _InfoCollector(f"{prefix}:cache_config_info", "Information of the engine's cache configuration.", info)
            )
        tokens = token_buckets(max_model_len)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = hist(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _TTFT_BUCKETS
        )
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", _ITL_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, one observation per request.",
            _ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_LATENCY_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time from arrival to the first scheduled step.", _REQUEST_LATENCY_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "Time from the first scheduled step to the first generated token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds", "Time from the first to the last generated token.", _REQUEST_LATENCY_BUCKETS
        )
        self.inference = hist(
            "request_inference_time_seconds",
            "Time from the first scheduled step to the last token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of each finished request.", tokens)
        self.generation_tokens = hist(
            "request_generation_tokens", "Generated tokens of each finished request (all its samples).", tokens
        )
        self.success = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        # Per running request: time of its latest token and each sample's token count.
        self._progress: dict[str, tuple[float, list[int]]] = {}

    def observe(self, out: RequestOutput) -> None:
        """Record one output of a request (called on the event loop for every step's output)."""
        if out.request_id.startswith(INTERNAL_REQUEST_PREFIX):
            return
        m = out.metrics
        last = m.get("last_token_time")
        counts = [len(c.token_ids) for c in out.outputs]
        prev = self._progress.get(out.request_id)
        if prev is not None and last is not None and last > prev[0]:
            for now_n, before_n in zip(counts, prev[1]):
                new = now_n - before_n
                for _ in range(max(new, 0)):
                    self.itl.labels(*self._labels).observe((last - prev[0]) / new)
        if last is not None:
            self._progress[out.request_id] = (last, counts)
        if out.finished:
            self._progress.pop(out.request_id, None)
            self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        labels = self._labels
        arrival, scheduled = m.get("arrival_time"), m.get("first_scheduled_time")
        first, last = m.get("first_token_time"), m.get("last_token_time", m.get("finished_time"))
        spans = [
            (self.ttft, arrival, first),
            (self.e2e, arrival, last),
            (self.queue, arrival, scheduled),
            (self.prefill, scheduled, first),
            (self.decode, first, last),
            (self.inference, scheduled, last),
        ]
        for histogram, start, end in spans:
            if start is not None and end is not None:
                histogram.labels(*labels).observe(max(end - start, 0.0))
        counts = [len(c.token_ids) for c in out.outputs]
        longest = max(counts, default=0)
        if first is not None and last is not None and longest > 1:
            self.tpot.labels(*labels).observe(max(last - first, 0.0) / (longest - 1))
        self.prompt_tokens.labels(*labels).observe(len(out.prompt_token_ids))
        self.generation_tokens.labels(*labels).observe(sum(counts))
        for c in out.outputs:
            self.success.labels(*labels, c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InfoCollector(Collector):
    """A gauge of value 1 whose labels carry configuration (Prometheus' info pattern)."""

    def __init__(self, name: str, doc: str, info: dict[str, str]) -> None:
        self._name, self._doc = name, doc
        self._info = {k: str(v) for k, v in info.items()}

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(self._name, self._doc, labels=list(self._info))
        g.add_metric(list(self._info.values()), 1.0)
        yield g


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
            "up": GaugeMetricFamily(
                "pagedserve:dp_replica_up",
                "1 while the replica serves, 0 once it exited.",
                labels=[*labels, "platform"],
            ),
            "running": GaugeMetricFamily(
                "pagedserve:dp_replica_num_requests_running", "Sequences in the replica's running batch.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "pagedserve:dp_replica_num_requests_waiting", "Sequences waiting in the replica's queue.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "pagedserve:dp_replica_kv_cache_usage_perc",
                "Fraction of the replica's KV-cache blocks in use.",
                labels=labels,
            ),
            "routed": CounterMetricFamily(
                "pagedserve:dp_replica_requests_routed", "Requests the router sent to the replica.", labels=labels
            ),
            "affinity": CounterMetricFamily(
                "pagedserve:dp_replica_requests_affinity_routed",
                "Requests sent to the replica for its cached prompt prefix.",
                labels=labels,
            ),
            "hits": CounterMetricFamily(
                "pagedserve:dp_replica_prefix_cache_hits",
                "Prompt tokens found in the replica's prefix cache.",
                labels=labels,
            ),
            "queries": CounterMetricFamily(
                "pagedserve:dp_replica_prefix_cache_queries",
                "Prompt tokens looked up in the replica's prefix cache.",
                labels=labels,
            ),
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
