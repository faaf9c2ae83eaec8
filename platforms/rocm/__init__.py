"""The builtin ROCm platform plugin (AMD GPUs through torch's HIP build)."""

from __future__ import annotations

from pagedserve.platforms.gpu_common import TorchGpuPlatform
from pagedserve.platforms.hookspecs import hookimpl

__all__ = ["RocmPlatform"]


class RocmPlatform(TorchGpuPlatform):
    name = "rocm"
    dist_backend = "nccl"  # torch maps "nccl" to RCCL on ROCm builds
    torch_build = "hip"
    build_hint = (
        "install a ROCm build of torch (e.g. pip install torch --index-url https://download.pytorch.org/whl/rocm6.2)"
    )


@hookimpl
def pagedserve_register_platforms(register):
    register(RocmPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, RocmPlatform):
        from pagedserve.platforms.rocm.ops import register_rocm_ops

        register_rocm_ops(ops)
