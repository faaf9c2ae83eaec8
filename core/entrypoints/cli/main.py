"""The `pagedserve` command line.  Each subcommand lives in its own module exposing
``add_parser(subparsers)`` and ``run(args) -> int``; modules are imported only when
needed so that `pagedserve platforms` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# subcommand -> module under pagedserve.entrypoints.cli
SUBCOMMANDS = {
    "serve": "serve_cmd",
    "generate": "generate_cmd",
    "bench": "bench_cmd",
    "platforms": "platforms_cmd",
    "build-kernels": "build_kernels_cmd",
    "simulate": "simulate_cmd",
    "eval": "eval_cmd",
    "run-batch": "run_batch_cmd",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: paged-KV LLM inference and serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if wanted in SUBCOMMANDS and name != wanted:
            sub.add_parser(name)  # listed in help without importing its module
            continue
        mod = importlib.import_module(f"pagedserve.entrypoints.cli.{module}")
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    mod = importlib.import_module(f"pagedserve.entrypoints.cli.{SUBCOMMANDS[args.command]}")
    return int(mod.run(args) or 0)
