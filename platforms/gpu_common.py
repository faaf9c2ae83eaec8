"""Shared pieces of the cuda and rocm platforms (both run on torch's "cuda" device)."""

from __future__ import annotations

import torch

from pagedserve.platforms.interface import Platform
from pagedserve.platforms.options import GpuOptions

__all__ = ["TorchGpuPlatform"]


class TorchGpuPlatform(Platform):
    """A GPU reached through torch's ``cuda`` device type (NVIDIA CUDA or AMD HIP builds)."""

    device_type = "cuda"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    pin_memory_available = True
    # PCIe 4.0 x16 with pinned host memory; a mid-range GPU's dense bf16 rate.
    host_copy_bandwidth = 20e9
    compute_flops = 1e14
    # The Triton attention and cache write read and write every 8-bit cache: int8 rows
    # with their scales, fp8 (e4m3, e5m2) rows with or without them (kernels/triton,
    # fp8 decoded in integer ops, so GPUs without fp8 instructions read them too); the
    # CUDA C++ ops hand 8-bit caches to them and copy blocks as bytes.
    kv_cache_dtypes = ("fp8_e4m3", "fp8_e5m2", "int8")
    #: "cuda" or "hip": which torch build this platform needs.
    torch_build: str = ""
    build_hint: str = ""

    def __init__(self, options: GpuOptions | None = None) -> None:
        #: The environment switches, read once here (PAGEDSERVE_CUDA_KERNELS; platforms/options.py).
        self.options = GpuOptions.from_env() if options is None else options

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        version = getattr(torch.version, cls.torch_build, None)
        if not version:
            other = "cuda" if torch.version.cuda else "hip" if getattr(torch.version, "hip", None) else None
            built = f"a {other} build" if other else "a CPU-only build"
            return False, f"torch {torch.__version__} is {built}; {cls.build_hint}"
        # device_count() asks the driver (NVML/HIP) without creating a context.
        count = torch.cuda.device_count()
        if count == 0:
            return False, (
                f"torch is built for {cls.torch_build} {version} but no {cls.name} device "
                "is visible (check the driver and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)"
            )
        return True, f"{count} device(s), torch {cls.torch_build} {version}"

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor):
        # A side stream so that weight streaming overlaps the layer being computed; it
        # first waits for the work already queued, which may still read ``dst``.
        stream = getattr(self, "_copy_stream", None)
        if stream is None:
            stream = self._copy_stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def release_memory(self) -> None:
        """Hand the caching allocator's free blocks back to the driver."""
        torch.cuda.empty_cache()

    def wait_copy(self, handle) -> None:
        if handle is not None:
            torch.cuda.current_stream().wait_event(handle)
