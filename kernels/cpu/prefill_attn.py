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

from pagedserve.kernels import build
from pagedserve.kernels.cpu.attention_amx import AmxAttention, bf16_kernel_unavailable_reason

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
    return bf16_kernel_unavailable_reason(BF16_FEATURES, features, arch)


def applicable() -> bool:
    """Whether this CPU runs the kernel (build_kernels(every=True) skips it elsewhere)."""
    return bf16_prefill_unavailable_reason() is None


def bf16_prefill_build_spec() -> build.ExtensionSpec:
    """The build of the kernel (the main kernels' arch flags)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("prefillbf16", SOURCES, arch, origin, headers=HEADERS)


class Bf16PrefillAttention(AmxAttention):
    """The loaded kernel: the AMX kernel's interface (:meth:`paged_attention` has the
    reference's signature; windows, soft caps, sinks, key ends, other dtypes and head
    sizes run the fallback, the platform's native kernel), on register tiles."""

    source = "cpu-bf16-prefill"
    op_call = "paged_attention:bf16_prefill"


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
