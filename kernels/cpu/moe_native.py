"""The native CPU kernel of the ``fused_moe`` op (kernels/cpu/moe.cpp): built just in
time by :func:`pagedserve.kernels.build.load_extension` into the shared kernel cache, as
a separate extension so that it never invalidates the main CPU kernels' build (the
arrangement of :mod:`pagedserve.kernels.cpu.lora_native`).  It includes the packed bf16
micro-kernels of linear.h, so those headers are part of its build key."""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from pagedserve.kernels import build

__all__ = ["load_moe_kernels", "moe_build_spec", "SOURCES", "HEADERS"]

SOURCES: tuple[str, ...] = ("moe.cpp",)
HEADERS: tuple[str, ...] = ("kernels.h", "vec.h", "elementwise.h", "linear.h")


def moe_build_spec() -> build.ExtensionSpec:
    """The build of the MoE CPU kernel for this machine (the main kernels' arch flags)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("moe", SOURCES, arch, origin, headers=HEADERS)


@functools.lru_cache(maxsize=1)
def load_moe_kernels() -> ModuleType | None:
    """The compiled module (``fused_moe``, ``has_packed``), or None with a warning saying why."""
    try:
        spec = moe_build_spec()
        bad = build.unsupported_arch_flags(list(spec.arch_flags), build.read_cpu_features())
        if bad:
            raise build.KernelBuildError(
                f"this CPU lacks the instructions of {' '.join(bad)} (from {spec.arch_origin})"
            )
        return build.load_extension(spec, "MoE CPU kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"MoE CPU kernel unavailable ({exc}); using the torch reference", stacklevel=2)
        return None
