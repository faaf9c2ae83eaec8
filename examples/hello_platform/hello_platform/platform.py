"""HelloPlatform: a toy platform whose "device" is the host CPU."""

from __future__ import annotations

import os

import torch

from pagedserve.platforms import Platform

__all__ = ["HelloPlatform"]


class HelloPlatform(Platform):
    """Runs everything on the host CPU, in float32, through pagedserve's public API only."""

    name = "hello"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.float32,)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        # A real plugin asks its driver here (cheaply: no device initialisation).
        return True, "hello runs wherever the host CPU does"

    def total_memory(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
