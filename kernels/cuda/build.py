"""Build the CUDA C++ kernels as a torch extension (on CUDA machines, on demand).

Nothing here runs at ``import pagedserve``: the extension is compiled the first time
:func:`load_cuda_extension` (or :func:`build_cuda_extension`) is called, through
:func:`pagedserve.kernels.build.load_extension` (torch's ``cpp_extension.load`` and
ninja, under the build lock every native build shares), into a persistent cache
directory keyed by the torch/CUDA versions, the target architectures and a hash of the
sources, so a rebuild happens only when one of those changes.

Environment honoured:
    MAX_JOBS               parallel compile jobs (read by torch's ninja build).
    TORCH_CUDA_ARCH_LIST   target architectures, e.g. "8.0;9.0" (default: the visible
                           GPUs' compute capabilities, as torch decides).
    PAGEDSERVE_KERNEL_CACHE  the kernel cache root of every native build (see
                           pagedserve.kernels.build.kernel_cache_root); builds go to
                           <root>/cuda/<key>.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType

from pagedserve.kernels import build

__all__ = [
    "EXTENSION_NAME",
    "SOURCE_DIR",
    "SOURCES",
    "HEADERS",
    "cuda_build_spec",
    "build_directory",
    "build_cuda_extension",
    "load_cuda_extension",
]

EXTENSION_NAME = "pagedserve_cuda_kernels"
SOURCE_DIR = Path(__file__).resolve().parent
#: Compiled sources: the torch binding and the nvcc-only kernel files.
SOURCES: tuple[str, ...] = ("binding.cpp", "paged_attention.cu", "cache_kernels.cu")
HEADERS: tuple[str, ...] = ("pagedserve_cuda.h", "common.cuh")

_NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
_CXX_FLAGS = ["-O3", "-std=c++17"]


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(" ".join(_NVCC_FLAGS + _CXX_FLAGS).encode())
    return h.hexdigest()[:16]


def _arch_tag() -> str:
    """The target architectures, as a path-safe string."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not archs:
        import torch

        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = ";".join(f"{major}.{minor}" for major, minor in caps) or "default"
    parts = [a.strip() for a in archs.replace(" ", ";").split(";") if a.strip()]
    return "sm" + "-".join(a.replace(".", "").replace("+", "p") for a in parts)


def build_directory() -> Path:
    """Where this torch/CUDA/arch/source combination is (or will be) built."""
    import torch

    key = f"torch{torch.__version__}-cu{torch.version.cuda}-{_arch_tag()}-{_source_hash()}"
    return build.kernel_cache_root() / "cuda" / key.replace("+", "_")


def _check_toolchain() -> None:
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        raise RuntimeError(
            f"the CUDA kernels need a CUDA build of torch; torch {torch.__version__} is not one "
            "(install one from https://download.pytorch.org/whl/cu126 or similar)"
        )
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("the CUDA kernels need the CUDA toolkit (nvcc); set CUDA_HOME or put nvcc on PATH")


def cuda_build_spec() -> build.ExtensionSpec:
    """The build of the extension for this torch, these architectures and these sources."""
    directory = build_directory()
    name = f"{EXTENSION_NAME}_{hashlib.sha256(directory.name.encode()).hexdigest()[:16]}"
    return build.ExtensionSpec(
        name=name,
        directory=directory,
        sources=tuple(SOURCE_DIR / s for s in SOURCES),
        cflags=tuple(_CXX_FLAGS),
        arch_flags=(_arch_tag(),),
        arch_origin="TORCH_CUDA_ARCH_LIST or the visible GPUs",
        compiler=os.environ.get("CXX", "c++"),
        include_dirs=(SOURCE_DIR,),
        cuda_cflags=tuple(_NVCC_FLAGS),
    )


def build_cuda_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse) the extension and import it.

    Returns the extension module with ``paged_attention_decode``,
    ``reshape_and_cache``, ``copy_blocks``, ``swap_blocks`` and ``supports_head_size``.
    Raises RuntimeError when torch has no CUDA or nvcc is missing, KernelBuildError
    (a RuntimeError) when the build fails.
    """
    _check_toolchain()
    return build.load_extension(cuda_build_spec(), "CUDA kernels", verbose)[0]


@functools.cache
def load_cuda_extension() -> ModuleType:
    """:func:`build_cuda_extension` once per process (quiet)."""
    return build_cuda_extension(verbose=False)
