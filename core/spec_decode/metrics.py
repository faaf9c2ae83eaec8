"""Prometheus families of speculative decoding, named like vLLM's (``pagedserve:`` for
``vllm:``), read from an ``EngineStats`` snapshot (all zero without speculation)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["spec_decode_metrics", "acceptance_rate"]


def acceptance_rate(stats) -> float:
    """Accepted draft tokens per draft token (0 without drafts)."""
    n = stats.spec_decode_num_draft_tokens
    return stats.spec_decode_num_accepted_tokens / n if n else 0.0


def spec_decode_metrics(stats, model_name: str, engine: str = "0", prefix: str = "pagedserve") -> Iterator[Metric]:
    """The counters of ``stats`` (an EngineStats), labelled ``model_name`` and ``engine``;
    ``prefix`` names them (``vllm`` for vLLM's dashboards)."""
    labels = [model_name, engine]
    for name, doc, value in (
        ("num_drafts", "Verification steps of requests that carried drafts.", stats.spec_decode_num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", stats.spec_decode_num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", stats.spec_decode_num_accepted_tokens),
    ):
        c = CounterMetricFamily(f"{prefix}:spec_decode_{name}", doc, labels=["model_name", "engine"])
        c.add_metric(labels, value)
        yield c
    per_pos = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "engine", "position"],
    )
    for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([model_name, engine, str(pos)], value)
    yield per_pos
