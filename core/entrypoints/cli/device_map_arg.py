"""The ``--device-map`` flag's converter (the field ``DeviceConfig.device_map`` names it)."""

from __future__ import annotations

import argparse

__all__ = ["device_map_arg"]


def device_map_arg(value: str) -> str:
    """argparse type: the map's syntax and its platform names, checked before anything
    loads (layer counts are checked against the model when the engine starts)."""
    from pagedserve.config import normalize_device_map
    from pagedserve.offload.device_map import check_device_map_platforms

    try:
        normalized = normalize_device_map(value)
        check_device_map_platforms(normalized)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return normalized
