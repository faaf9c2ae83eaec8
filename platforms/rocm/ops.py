"""Op overrides of the ROCm platform: the Triton kernels (Triton targets AMD GPUs too)
and the torch-provided quantized ops (FP8 emulated)."""

from __future__ import annotations

from pagedserve.platforms.cuda.ops import register_triton_ops
from pagedserve.platforms.cuda.quant_ops import register_gpu_quant_ops
from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_rocm_ops"]


def register_rocm_ops(ops: OpRegistry) -> None:
    """Install the ROCm platform's kernels into ``ops``."""
    register_gpu_quant_ops(ops, fp8_scaled_mm=False)
    register_triton_ops(ops, "rocm")
