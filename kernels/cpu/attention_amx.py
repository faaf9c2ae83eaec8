"""Paged attention on AMX bf16 tiles (kernels/cpu/attention_amx.cpp): a separate
extension, compiled with ``-mamx-tile -mamx-bf16`` and built and loaded only where the
CPU has AMX, so that the main CPU kernels build and run everywhere else.

:func:`amx_unavailable_reason` says why it is off on this machine (None: it can be
built here); :func:`load_amx_attention` builds it just in time into the shared kernel
cache (kernels/build.py) and returns an :class:`AmxAttention` (or None with a warning).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu.native import OP_CALLS

__all__ = [
    "AMX_FEATURES",
    "AmxAttention",
    "amx_build_spec",
    "amx_unavailable_reason",
    "applicable",
    "load_amx_attention",
]

SOURCES: tuple[str, ...] = ("attention_amx.cpp",)
HEADERS: tuple[str, ...] = ("amx.h", "vec.h")
#: /proc/cpuinfo flags the kernel needs: the tiles, their bf16 products, and AVX-512
#: BF16 for the softmax and the packing around them.
AMX_FEATURES: frozenset[str] = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
AMX_FLAGS: tuple[str, ...] = ("-mamx-tile", "-mamx-bf16")


def bf16_kernel_unavailable_reason(
    needed: frozenset[str], features: frozenset[str] | None = None, arch: list[str] | None = None
) -> str | None:
    """Why a kernel built on the main kernels' AVX-512 BF16 arch flags and needing the CPU
    flags ``needed`` cannot be used here, or None where it can."""
    features = build.read_cpu_features() if features is None else features
    missing = sorted(needed - features)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    arch = build.cpu_arch_flags()[0] if arch is None else arch
    if "-mavx512bf16" not in arch:
        return "the arch flags leave out AVX-512 BF16 (PAGEDSERVE_CPU_ARCH_FLAGS)"
    return None


def amx_unavailable_reason(features: frozenset[str] | None = None, arch: list[str] | None = None) -> str | None:
    """Why the AMX attention cannot be used here, or None where it can."""
    return bf16_kernel_unavailable_reason(AMX_FEATURES, features, arch)


def applicable() -> bool:
    """Whether this CPU runs the AMX attention (build_kernels(every=True) skips it elsewhere)."""
    return amx_unavailable_reason() is None


def amx_build_spec() -> build.ExtensionSpec:
    """The build of the AMX attention kernel (the main kernels' arch flags plus AMX)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("attnamx", SOURCES, [*arch, *AMX_FLAGS], origin, headers=HEADERS)


class AmxAttention:
    """The loaded kernel: :meth:`paged_attention` has the reference's signature."""

    source = "cpu-amx"
    #: Its key in native.OP_CALLS.
    op_call = "paged_attention:amx"

    def __init__(self, module: ModuleType, fallback: Callable[..., torch.Tensor] | None = None) -> None:
        self.module = module
        self.head_sizes = frozenset(module.head_sizes())
        #: What runs what the tiles do not take (default: the reference).
        self.fallback = reference.paged_attention if fallback is None else fallback

    def with_fallback(self, fallback: Callable[..., torch.Tensor]) -> AmxAttention:
        """The same kernel, sending what the tiles do not take to ``fallback``."""
        return type(self)(self.module, fallback)

    def supports(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether the tiles take these tensors (else the caller's fallback runs)."""
        return (
            query.dtype == torch.bfloat16
            and key_cache.dtype == torch.bfloat16
            and value_cache.dtype == torch.bfloat16
            and query.shape[-1] in self.head_sizes
            and query.is_cpu
            and query.stride(-1) == 1
            and key_cache.stride(-1) == 1
            and value_cache.stride(-1) == 1
        )

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        key_ends: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See reference.paged_attention.  Windows, soft caps, sinks, key ends, other
        dtypes and head sizes run the fallback (the platform's: the native kernel)."""
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        plain = sliding_window is None and soft_cap is None and sinks is None and key_ends is None
        if (
            plain
            and out.dtype == torch.bfloat16
            and out.stride(-1) == 1
            and self.supports(query, key_cache, value_cache)
        ):
            self.module.paged_attention(
                query,
                key_cache,
                value_cache,
                block_tables.to(torch.int32).contiguous(),
                seq_lens.to(torch.int32).contiguous(),
                query_start_loc.to(torch.int32).contiguous(),
                float(scale),
                out,
            )
            OP_CALLS[self.op_call] = OP_CALLS.get(self.op_call, 0) + 1
            return out
        return self.fallback(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            out,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
            key_ends=key_ends,
        )


@functools.lru_cache(maxsize=1)
def load_amx_attention() -> AmxAttention | None:
    """The AMX attention kernel, or None: silently where the CPU has no AMX, with a
    warning where it has but the build or the tile-state request failed."""
    if amx_unavailable_reason() is not None:
        return None
    try:
        module = build.load_extension(amx_build_spec(), "AMX attention kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"AMX attention unavailable ({exc}); using the native kernel", stacklevel=2)
        return None
    if not module.available():
        warnings.warn("AMX attention unavailable: Linux refused the AMX tile state", stacklevel=2)
        return None
    return AmxAttention(module)
