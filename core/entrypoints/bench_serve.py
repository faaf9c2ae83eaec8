"""Load benchmark of a running `pagedserve serve` (Poisson arrivals)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("pagedserve bench serve is not available yet")
