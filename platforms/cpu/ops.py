"""Op overrides of the CPU platform: the native kernels where they build and load."""

from __future__ import annotations

from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_cpu_ops"]


def register_cpu_ops(ops: OpRegistry) -> None:
    """Install the CPU platform's ops into ``ops``.

    Loads the native kernels (compiling them on first use; see kernels/build.py).
    When they are disabled (PAGEDSERVE_CPU_KERNELS=0) or cannot be built, the torch
    references stay registered; the loader has already warned why.
    """
    from pagedserve.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        return
    for name, fn in kernels.ops().items():
        ops.register(name, fn, source=kernels.source)
