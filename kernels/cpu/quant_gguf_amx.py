"""GGUF linears on AMX int8 tiles (kernels/cpu/quant_gguf_amx.cpp): a separate
extension, compiled with ``-mamx-tile -mamx-int8`` and built and loaded only where the
CPU has them, so that the quantized kernels build and run everywhere else.

It reads the weights as :func:`pagedserve.platforms.cpu.quant_ops.prepare_gguf_weight`
repacks them for the AVX-512 VNNI tiled kernel (one copy serves both) and returns that
kernel's result bit for bit.  :func:`amx_int8_unavailable_reason` says why it is off on
this machine (None: it can be built here); :func:`load_gguf_amx` builds it just in time
into the shared kernel cache (kernels/build.py) and returns the module (or None).
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from pagedserve.kernels import build

__all__ = ["AMX_INT8_FEATURES", "amx_int8_unavailable_reason", "applicable", "gguf_amx_build_spec", "load_gguf_amx"]

SOURCES: tuple[str, ...] = ("quant_gguf_amx.cpp",)
HEADERS: tuple[str, ...] = ("amx.h", "elementwise.h", "kernels.h", "quant_gguf_common.h", "vec.h")
#: /proc/cpuinfo flags the kernel needs: the tiles, their int8 products, and AVX-512
#: (BW for the activation quantization, BF16 for the bf16 output rounding).
AMX_INT8_FEATURES: frozenset[str] = frozenset({"amx_tile", "amx_int8", "amx_bf16", "avx512bw", "avx512_bf16"})
AMX_INT8_FLAGS: tuple[str, ...] = ("-mamx-tile", "-mamx-int8", "-mamx-bf16")


def amx_int8_unavailable_reason(features: frozenset[str] | None = None, arch: list[str] | None = None) -> str | None:
    """Why the AMX int8 GGUF kernel cannot be used here, or None where it can."""
    features = build.read_cpu_features() if features is None else features
    missing = sorted(AMX_INT8_FEATURES - features)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    arch = build.cpu_arch_flags()[0] if arch is None else arch
    if "-mavx512bf16" not in arch or "-mavx512bw" not in arch:
        return "the arch flags leave out AVX-512 BW/BF16 (PAGEDSERVE_CPU_ARCH_FLAGS)"
    return None


def applicable() -> bool:
    """Whether this CPU runs the kernel (build_kernels(every=True) skips it elsewhere)."""
    return amx_int8_unavailable_reason() is None


def gguf_amx_build_spec() -> build.ExtensionSpec:
    """The build of the AMX int8 GGUF kernel (the main kernels' arch flags plus AMX)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("quantamx", SOURCES, [*arch, *AMX_INT8_FLAGS], origin, headers=HEADERS)


@functools.lru_cache(maxsize=1)
def load_gguf_amx() -> ModuleType | None:
    """The compiled module (``available``, ``gguf_linear_out``), or None: silently where
    the CPU has no AMX int8, with a warning where it has but the build or the tile-state
    request failed."""
    if amx_int8_unavailable_reason() is not None:
        return None
    try:
        module = build.load_extension(gguf_amx_build_spec(), "AMX int8 GGUF kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"AMX int8 GGUF kernel unavailable ({exc}); using the VNNI kernel", stacklevel=2)
        return None
    if not module.available():
        warnings.warn("AMX int8 GGUF kernel unavailable: Linux refused the AMX tile state", stacklevel=2)
        return None
    return module
