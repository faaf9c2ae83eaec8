"""Op overrides of the ROCm platform."""

from __future__ import annotations

from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_rocm_ops"]


def register_rocm_ops(ops: OpRegistry) -> None:
    """Install the ROCm platform's kernels into ``ops``."""
