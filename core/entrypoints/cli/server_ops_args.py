"""`pagedserve serve` flags for operations: metrics naming, logs, TLS and proxies
(vLLM's spellings), and the `ServerSettings` / uvicorn options they become."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_ops_arguments", "ops_settings", "uvicorn_options"]


def add_ops_arguments(parser: argparse.ArgumentParser) -> None:
    ops = parser.add_argument_group("logs, metrics and TLS (docs/serving.md)")
    ops.add_argument(
        "--metrics-prefix",
        default="pagedserve",
        choices=["pagedserve", "vllm"],
        help="name prefix of every /metrics series; 'vllm' makes dashboards written for vLLM work unchanged",
    )
    ops.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between the periodic throughput/queue/KV stats log lines",
    )
    ops.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log lines")
    ops.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt and sampling parameters when it arrives, and when it ends",
    )
    ops.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: log at most this many prompt characters / token ids",
    )
    ops.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="'json': one JSON object per log line, for log collectors",
    )
    ops.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    ops.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    ops.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    ops.add_argument(
        "--root-path", default=None, help="the path prefix under which a reverse proxy serves this app (ASGI root_path)"
    )


def ops_settings(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """`ServerSettings` fields from the flags and the engine configuration."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not args.disable_log_stats and args.stats_interval <= 0:
        raise ValueError(f"--stats-interval must be positive, got {args.stats_interval}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    cache = config.cache
    info = {
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "cache_dtype": cache.cache_dtype,
        "kv_cache_memory": cache.kv_cache_memory,
        "kv_offload_memory": cache.kv_offload_memory,
        "preemption_mode": cache.preemption_mode,
    }
    return {
        "metrics_prefix": args.metrics_prefix,
        "cache_info": {k: str(v) for k, v in info.items()},
        "stats_interval": None if args.disable_log_stats else args.stats_interval,
        "log_requests": args.enable_log_requests,
        "max_log_len": args.max_log_len,
    }


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """TLS and root-path keyword arguments for `uvicorn.run`."""
    opts: dict[str, Any] = {}
    if args.ssl_keyfile:
        opts.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    if args.ssl_ca_certs:
        opts["ssl_ca_certs"] = args.ssl_ca_certs
    if args.root_path:
        opts["root_path"] = args.root_path
    return opts
