"""The native CPU kernel of ``mla_paged_attention`` (kernels/cpu/mla_attention.cpp):
built just in time through :mod:`pagedserve.kernels.build` into the same persistent
cache, as a separate extension so that it never invalidates the main CPU kernels' build.

The CPU platform registers it only where its options allow native kernels
(``CpuOptions.native_kernels``: PAGEDSERVE_CPU_KERNELS=0 turns it off with the others);
nothing here reads the environment.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

from pagedserve.kernels import build, reference

__all__ = ["load_mla_kernels", "mla_build_spec", "mla_paged_attention", "SOURCE"]

SOURCES: tuple[str, ...] = ("mla_attention.cpp",)
#: How ``pagedserve platforms --ops`` names this implementation.
SOURCE = "cpu-native-mla"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mla_build_spec() -> build.ExtensionSpec:
    """The build for this machine (portable flags: the compiler vectorizes the loops)."""
    return build.cpu_extension_spec("mla", SOURCES)


@functools.lru_cache(maxsize=1)
def load_mla_kernels() -> ModuleType | None:
    """The compiled module, or None with a warning saying why."""
    try:
        return build.load_extension(mla_build_spec(), "the latent-attention CPU kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"latent-attention CPU kernel unavailable ({exc}); using the torch reference", stacklevel=2)
        return None


def mla_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.mla_paged_attention`` through the native kernel: CPU tensors whose query,
    caches and output share float32, bfloat16 or float16; anything else (an 8-bit cache,
    shapes the reference refuses) goes to the reference."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank)
    tensors = [query, key_cache, value_cache, block_tables, seq_lens, query_start_loc]
    width = query.shape[-1]
    if (
        any(t.device.type != "cpu" for t in tensors)
        or query.dtype not in _DTYPES
        or key_cache.dtype != query.dtype
        or value_cache.dtype != query.dtype
        or key_cache.dim() != 4
        or key_cache.shape[2] != 1
        or tuple(value_cache.shape) != tuple(key_cache.shape)
        or value_cache.stride() != key_cache.stride()
        or not 0 < kv_lora_rank < width <= 2 * key_cache.shape[3]
        or (out is not None and (out.dtype != query.dtype or out.device.type != "cpu"))
    ):
        return reference.mla_paged_attention(*args, out=out)
    module = load_mla_kernels()  # built on first use, not when the platform is chosen
    if module is None:
        return reference.mla_paged_attention(*args, out=out)
    if out is None:
        out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
    return module.mla_paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32),
        float(scale),
        int(kv_lora_rank),
        out,
    )
