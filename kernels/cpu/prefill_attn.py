"""Paged attention of prefill chunks on AVX-512 BF16 register tiles
(kernels/cpu/prefill_attn_bf16.cpp): a separate extension, built with the main kernels'
arch flags and only where the CPU has AVX-512 BF16, for the CPUs without AMX (where the
AMX kernel, kernels/cpu/attention_amx.py, takes prefill chunks instead).

:func:`bf16_prefill_unavailable_reason` says why it is off on this machine (None: it can
be built here); :func:`load_bf16_prefill_attention` builds it just in time into the
shared kernel cache (kernels/build.py) and returns a :class:`Bf16PrefillAttention` (or
None with a warning).
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
    "BF16_FEATURES",
    "Bf16PrefillAttention",
    "applicable",
    "bf16_prefill_build_spec",
    "bf16_prefill_unavailable_reason",
    "load_bf16_prefill_attention",
]

SOURCES: tuple[str, ...] = ("prefill_attn_bf16.cpp",)
HEADERS: tuple[str, ...] = ("vec.h",)
#: /proc/cpuinfo flags the kernel needs.
BF16_FEATURES: frozenset[str] = frozenset({"avx512f", "avx512bw", "avx512_bf16"})


def bf16_prefill_unavailable_reason(
    features: frozenset[str] | None = None, arch: list[str] | None = None
) -> str | None:
    """Why the AVX-512 BF16 prefill attention cannot be used here, or None where it can."""
    features = build.read_cpu_features() if features is None else features
    missing = sorted(BF16_FEATURES - features)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    arch = build.cpu_arch_flags()[0] if arch is None else arch
    if "-mavx512bf16" not in arch:
        return "the arch flags leave out AVX-512 BF16 (PAGEDSERVE_CPU_ARCH_FLAGS)"
    return None


def applicable() -> bool:
    """Whether this CPU runs the kernel (build_kernels(every=True) skips it elsewhere)."""
    return bf16_prefill_unavailable_reason() is None


def bf16_prefill_build_spec() -> build.ExtensionSpec:
    """The build of the kernel (the main kernels' arch flags)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("prefillbf16", SOURCES, arch, origin, headers=HEADERS)


class Bf16PrefillAttention:
    """The loaded kernel: :meth:`paged_attention` has the reference's signature."""

    source = "cpu-bf16-prefill"

    def __init__(self, module: ModuleType, fallback: Callable[..., torch.Tensor] | None = None) -> None:
        self.module = module
        self.head_sizes = frozenset(module.head_sizes())
        #: What runs what the kernel does not take (default: the reference).
        self.fallback = reference.paged_attention if fallback is None else fallback

    def with_fallback(self, fallback: Callable[..., torch.Tensor]) -> Bf16PrefillAttention:
        """The same kernel, sending what it does not take to ``fallback``."""
        return Bf16PrefillAttention(self.module, fallback)

    def supports(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether the kernel takes these tensors (else the fallback runs)."""
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
            OP_CALLS["paged_attention:bf16_prefill"] = OP_CALLS.get("paged_attention:bf16_prefill", 0) + 1
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
def load_bf16_prefill_attention() -> Bf16PrefillAttention | None:
    """The kernel, or None: silently where the CPU lacks AVX-512 BF16, with a warning
    where it has it but the build failed."""
    if bf16_prefill_unavailable_reason() is not None:
        return None
    try:
        module = build.load_extension(bf16_prefill_build_spec(), "bf16 prefill attention kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"bf16 prefill attention unavailable ({exc}); using the native kernel", stacklevel=2)
        return None
    return Bf16PrefillAttention(module)
