"""The ``--device-map`` option shared by `pagedserve serve`, `generate` and `bench throughput`."""

from __future__ import annotations

import argparse

__all__ = ["add_device_map_argument", "device_map_arg"]

HELP = ("decoder layers split across platforms: 'cuda:20,cpu' (the first 20 layers on cuda, the rest "
        "on cpu) or inclusive ranges 'cpu:0-14,cuda:15-29' (docs/memory.md)")


def device_map_arg(value: str) -> str:
    """argparse type: the map's syntax and its platform names, checked before anything
    loads (layer counts are checked against the model when the engine starts)."""
    from pagedserve.config import parse_device_map
    from pagedserve.offload.device_map import check_device_map_platforms

    try:
        normalized = ",".join(map(str, parse_device_map(value)))
        check_device_map_platforms(normalized)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return normalized


def add_device_map_argument(parser) -> None:
    parser.add_argument("--device-map", type=device_map_arg, default=None, metavar="MAP", help=HELP)
