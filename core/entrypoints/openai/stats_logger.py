"""The server's logs besides HTTP access lines: a periodic stats line, per-request lines,
and a JSON line format for log collectors.

    INFO ... pagedserve.stats: Avg prompt throughput: 312.4 tokens/s, Avg generation throughput:
    88.1 tokens/s, Running: 12 reqs, Waiting: 0 reqs, KV cache usage: 7.3%, Prefix cache hit rate: 41.0%

The stats line reads the engine's statistics snapshot (never the engine itself), so it
costs the engine thread nothing; throughputs are over the interval since the last line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedserve.engine import EngineStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["StatsLogger", "RequestLogger", "JsonFormatter", "configure_logging", "format_stats"]

stats_log = logging.getLogger("pagedserve.stats")
request_log = logging.getLogger("pagedserve.requests")


def format_stats(prev: EngineStats, now: EngineStats, seconds: float) -> str:
    """vLLM's stats line between two snapshots `seconds` apart."""
    seconds = max(seconds, 1e-9)
    queries = now.prefix_cache_queries - prev.prefix_cache_queries
    hits = now.prefix_cache_hits - prev.prefix_cache_hits
    return (
        f"Avg prompt throughput: {(now.prompt_tokens - prev.prompt_tokens) / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {(now.generation_tokens - prev.generation_tokens) / seconds:.1f} tokens/s, "
        f"Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, "
        f"KV cache usage: {100 * now.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
    )


class StatsLogger:
    """Logs `format_stats` every `interval` seconds while there is anything to report
    (one line when the engine goes idle, then silence until work arrives)."""

    def __init__(self, stats: Callable[[], EngineStats], interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"the stats interval must be positive, got {interval}")
        self._stats = stats
        self.interval = interval

    def line(self, prev: EngineStats, now: EngineStats, seconds: float) -> str | None:
        moved = (now.prompt_tokens, now.generation_tokens) != (prev.prompt_tokens, prev.generation_tokens)
        busy = now.num_running or now.num_waiting
        return format_stats(prev, now, seconds) if moved or busy else None

    async def run(self) -> None:
        prev, t_prev = self._stats(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now, t_now = self._stats(), time.monotonic()
            text = self.line(prev, now, t_now - t_prev)
            if text is not None:
                stats_log.info(text, extra={"stats": _stats_fields(prev, now, t_now - t_prev)})
            prev, t_prev = now, t_now


def _stats_fields(prev: EngineStats, now: EngineStats, seconds: float) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {
        "prompt_throughput": (now.prompt_tokens - prev.prompt_tokens) / seconds,
        "generation_throughput": (now.generation_tokens - prev.generation_tokens) / seconds,
        "running": now.num_running,
        "waiting": now.num_waiting,
        "kv_cache_usage": now.kv_cache_usage,
    }


class RequestLogger:
    """--enable-log-requests: one line when a request arrives (prompt and parameters, cut
    to `max_log_len` characters and token ids) and one when it finishes."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def _cut(self, value: Any) -> Any:
        if self.max_log_len is None or value is None:
            return value
        return value[: self.max_log_len]

    def received(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        request_log.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            self._cut(prompt),
            params,
            self._cut(prompt_token_ids),
            extra={"request_id": request_id},
        )

    def finished(self, out: RequestOutput) -> None:
        reasons = ",".join(str(c.finish_reason) for c in out.outputs)
        tokens = sum(len(c.token_ids) for c in out.outputs)
        request_log.info(
            "Finished request %s: finish_reason=%s, prompt_tokens=%d, generated_tokens=%d",
            out.request_id,
            reasons,
            len(out.prompt_token_ids),
            tokens,
            extra={"request_id": out.request_id},
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any structured extras."""

    _EXTRAS = ("request_id", "stats")

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in self._EXTRAS:
            if hasattr(record, key):
                body[key] = getattr(record, key)
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str = "text") -> dict | None:
    """Set up the root logger; returns the uvicorn ``log_config`` to use (None: uvicorn
    leaves logging alone and its records reach the root handler, formatted alike)."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if log_format == "json":
        return None
    import uvicorn.config

    return uvicorn.config.LOGGING_CONFIG
