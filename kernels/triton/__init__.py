"""Paged-attention and cache-write kernels in Triton (CUDA and ROCm).

Triton is an optional dependency (``pip install triton``): these names are resolved
lazily so that ``import pagedserve`` and the CPU platform never import it.

    from pagedserve.kernels.triton import paged_attention, reshape_and_cache
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = [
    "triton_ops",
    "paged_attention",
    "paged_attention_fixed_splits",
    "choose_num_splits",
    "reshape_and_cache",
    "apply_token_bitmask",
]

_LAZY = {
    "paged_attention": "pagedserve.kernels.triton.attention",
    "paged_attention_fixed_splits": "pagedserve.kernels.triton.attention",
    "choose_num_splits": "pagedserve.kernels.triton.attention",
    "reshape_and_cache": "pagedserve.kernels.triton.cache",
    "apply_token_bitmask": "pagedserve.kernels.triton.bitmask",
}

if TYPE_CHECKING:
    from pagedserve.kernels.triton.attention import (
        choose_num_splits,
        paged_attention,
        paged_attention_fixed_splits,
    )
    from pagedserve.kernels.triton.cache import reshape_and_cache


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedserve.kernels.triton' has no attribute {name!r}")


def triton_ops() -> dict[str, Callable[..., Any]]:
    """The op-registry entries these kernels provide, by op name (imports triton).

    Raises ImportError when triton is not installed.
    """
    from pagedserve.kernels.triton import attention, bitmask, cache

    return {
        "paged_attention": attention.paged_attention,
        "reshape_and_cache": cache.reshape_and_cache,
        "apply_token_bitmask": bitmask.apply_token_bitmask,
    }
