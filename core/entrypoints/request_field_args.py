"""Flags of the request-field features: the scheduling policy that ``priority`` needs and
where sampling defaults come from (vLLM's spellings)."""

from __future__ import annotations

import argparse

__all__ = ["add_request_field_arguments"]


def add_request_field_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: a request's 'priority' (lower first), then arrival; "
        "preemption takes the lowest-priority running request",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: 'auto' (the checkpoint's generation_config.json), 'ignore', "
        "or a folder holding generation_config.json",
    )
