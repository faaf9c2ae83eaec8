"""`pagedserve simulate`: the capacity planner; it lives in pagedserve.simulate."""

from __future__ import annotations

from pagedserve.simulate.cli import add_parser, run

__all__ = ["add_parser", "run"]
