"""The builtin CPU platform plugin."""

from __future__ import annotations

from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.hookspecs import hookimpl

__all__ = ["CpuPlatform"]


@hookimpl
def pagedserve_register_platforms(register):
    register(CpuPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, CpuPlatform):
        from pagedserve.platforms.cpu.ops import register_cpu_ops

        register_cpu_ops(ops, platform.options)
