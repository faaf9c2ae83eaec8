"""`pagedserve bench throughput|serve`: benchmarks (never tests)."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser", "run"]

_KINDS = {"throughput": "bench_throughput", "serve": "bench_serve"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark")
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    for kind, module in _KINDS.items():
        mod = importlib.import_module(f"pagedserve.entrypoints.cli.{module}")
        sp = kinds.add_parser(kind, help=mod.__doc__.splitlines()[0] if mod.__doc__ else None)
        mod.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(f"pagedserve.entrypoints.cli.{_KINDS[args.bench_kind]}")
    return int(mod.run(args) or 0)
