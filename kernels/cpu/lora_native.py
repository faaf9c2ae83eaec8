"""The native CPU kernel of the batched multi-LoRA op (kernels/cpu/lora.cpp): built just
in time by :func:`pagedserve.kernels.build.load_extension` into the same persistent
cache, as a separate extension so that it never invalidates the main CPU kernels'
build (the same arrangement as :mod:`pagedserve.kernels.cpu.quant_native`)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import warnings
from types import ModuleType

from pagedserve.kernels import build

__all__ = ["load_lora_kernels", "lora_build_spec"]

SOURCES: tuple[str, ...] = ("lora.cpp",)


def lora_build_spec() -> build.ExtensionSpec:
    """The build of the LoRA CPU kernel for this machine."""
    import torch

    arch, origin = build.cpu_arch_flags()
    cflags = (*build.BASE_CFLAGS, *arch)
    compiler = os.environ.get("CXX", "c++")
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((build.CPU_DIR / name).read_bytes())
    digest.update(json.dumps([cflags, compiler, torch.__version__, sys.version_info[:2], platform.machine()]).encode())
    name = f"pagedserve_lora_{digest.hexdigest()[:16]}"
    return build.ExtensionSpec(
        name=name,
        directory=build.kernel_cache_root() / name,
        sources=tuple(build.CPU_DIR / s for s in SOURCES),
        cflags=cflags,
        arch_flags=tuple(arch),
        arch_origin=origin,
        compiler=compiler,
    )


@functools.lru_cache(maxsize=1)
def load_lora_kernels() -> ModuleType | None:
    """The compiled module (``lora_linear``), or None with a warning saying why."""
    try:
        return build.load_extension(lora_build_spec(), "LoRA CPU kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"LoRA CPU kernel unavailable ({exc}); using the torch reference", stacklevel=2)
        return None
