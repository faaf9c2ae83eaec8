"""The builtin CUDA platform plugin (NVIDIA GPUs)."""

from __future__ import annotations

from pagedserve.platforms.gpu_common import TorchGpuPlatform
from pagedserve.platforms.hookspecs import hookimpl

__all__ = ["CudaPlatform"]


class CudaPlatform(TorchGpuPlatform):
    name = "cuda"
    dist_backend = "nccl"
    torch_build = "cuda"
    build_hint = (
        "install a CUDA build of torch (e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126)"
    )


@hookimpl
def pagedserve_register_platforms(register):
    register(CudaPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, CudaPlatform):
        from pagedserve.platforms.cuda.ops import register_cuda_ops

        register_cuda_ops(ops, platform.options)
