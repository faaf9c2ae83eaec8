"""Op overrides of the CPU platform (native kernels where they are built)."""

from __future__ import annotations

from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_cpu_ops"]


def register_cpu_ops(ops: OpRegistry) -> None:
    """Install the CPU platform's ops into ``ops``."""
