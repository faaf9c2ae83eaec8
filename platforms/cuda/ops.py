"""Op overrides of the CUDA platform."""

from __future__ import annotations

from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_cuda_ops"]


def register_cuda_ops(ops: OpRegistry) -> None:
    """Install the CUDA platform's kernels into ``ops``."""
