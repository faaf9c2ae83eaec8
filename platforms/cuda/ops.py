"""Op overrides of the CUDA platform.

By default the Triton kernels serve ``paged_attention`` and ``reshape_and_cache``.
``PAGEDSERVE_CUDA_KERNELS=cuda`` selects the CUDA C++ kernels instead (and adds
``copy_blocks``/``swap_blocks``); they are compiled on first selection, into the cache
described in :mod:`pagedserve.kernels.cuda.build`.  ``PAGEDSERVE_CUDA_KERNELS=triton``
is the default.
"""

from __future__ import annotations

import os
import warnings

from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_cuda_ops", "register_triton_ops", "KERNELS_ENV", "kernel_choice"]

KERNELS_ENV = "PAGEDSERVE_CUDA_KERNELS"
_CHOICES = ("triton", "cuda")


def kernel_choice() -> str:
    """The kernel family selected by ``PAGEDSERVE_CUDA_KERNELS`` ("triton" or "cuda")."""
    choice = os.environ.get(KERNELS_ENV, "triton").strip().lower() or "triton"
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r} is not one of {', '.join(_CHOICES)}")
    return choice


def register_triton_ops(ops: OpRegistry, platform_name: str) -> None:
    """Install the Triton kernels; without triton the reference ops stay, with a warning."""
    try:
        from pagedserve.kernels.triton import triton_ops

        kernels = triton_ops()
    except ImportError as exc:
        warnings.warn(
            f"{platform_name}: triton is not importable ({exc}); paged_attention and "
            "reshape_and_cache use the slow torch reference.  Install it with `pip install triton`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    for name, fn in kernels.items():
        ops.register(name, fn, source="triton")


def register_cuda_ops(ops: OpRegistry) -> None:
    """Install the CUDA platform's kernels into ``ops`` (see the module docstring)."""
    if kernel_choice() == "triton":
        register_triton_ops(ops, "cuda")
        return
    from pagedserve.kernels.cuda import ops as cuda_ops
    from pagedserve.kernels.cuda.build import load_cuda_extension

    # Build now so that a compiler error surfaces at start-up, not in the first forward.
    load_cuda_extension()
    for name in ("paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"):
        ops.register(name, getattr(cuda_ops, name), source="cuda")
