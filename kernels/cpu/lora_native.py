"""The native CPU kernel of the batched multi-LoRA op (kernels/cpu/lora.cpp): built just
in time by :func:`pagedserve.kernels.build.load_extension` into the same persistent
cache, as a separate extension so that it never invalidates the main CPU kernels'
build (the same arrangement as :mod:`pagedserve.kernels.cpu.quant_native`)."""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from pagedserve.kernels import build

__all__ = ["load_lora_kernels", "lora_build_spec"]

SOURCES: tuple[str, ...] = ("lora.cpp",)


def lora_build_spec() -> build.ExtensionSpec:
    """The build of the LoRA CPU kernel for this machine."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("lora", SOURCES, arch, origin)


@functools.lru_cache(maxsize=1)
def load_lora_kernels() -> ModuleType | None:
    """The compiled module (``lora_linear``), or None with a warning saying why."""
    try:
        return build.load_extension(lora_build_spec(), "LoRA CPU kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"LoRA CPU kernel unavailable ({exc}); using the torch reference", stacklevel=2)
        return None
