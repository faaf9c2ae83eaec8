"""Op overrides of the CUDA platform.

By default the Triton kernels serve ``paged_attention``, ``reshape_and_cache``,
``gguf_linear`` and the recurrent layers' ops (decode steps and prefill forms).  ``PAGEDSERVE_CUDA_KERNELS=cuda``
selects the CUDA C++ kernels for attention and the cache instead (and adds ``copy_blocks``/``swap_blocks``); they are
compiled on first selection, into the cache described in
:mod:`pagedserve.kernels.cuda.build`.  ``PAGEDSERVE_CUDA_KERNELS=triton`` is the
default.  The other quantized linear ops come from platforms/cuda/quant_ops.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from pagedserve.platforms.ops import GGUF_OUT_DTYPE, OpRegistry
from pagedserve.platforms.options import GpuOptions

__all__ = ["register_cuda_ops", "register_triton_ops", "TRITON_OPS"]

#: The ops served by Triton kernels.
TRITON_OPS: tuple[str, ...] = (
    "paged_attention",
    "reshape_and_cache",
    "gguf_linear",
    "apply_token_bitmask",
    "lora_linear",
    "fused_moe",
    "gated_delta_rule_recurrent",
    "mamba2_ssd_step",
    "mamba1_scan_step",
    "causal_conv1d_update",
    "gated_delta_rule",
    "mamba2_ssd",
    "mamba1_scan",
    "causal_conv1d",
)
#: The recurrent layers' ops: decode steps (kernels/triton/recurrent.py) and prefill
#: forms (kernels/triton/recurrent_prefill.py).
_RECURRENT_OPS: tuple[str, ...] = (
    "gated_delta_rule_recurrent",
    "mamba2_ssd_step",
    "mamba1_scan_step",
    "causal_conv1d_update",
    "gated_delta_rule",
    "mamba2_ssd",
    "mamba1_scan",
    "causal_conv1d",
)
#: The ops the CUDA C++ kernels serve under PAGEDSERVE_CUDA_KERNELS=cuda.
_CUDA_CPP_OPS: tuple[str, ...] = ("paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks")


def _triton_kernels() -> dict[str, Callable[..., Any]]:
    """Every Triton kernel by op name (imports triton; ImportError without it)."""
    from pagedserve.kernels.triton import triton_ops
    from pagedserve.kernels.triton.lora import lora_linear_triton
    from pagedserve.kernels.triton.moe import fused_moe_triton
    from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
    from pagedserve.kernels.triton.recurrent import (
        causal_conv1d_update_triton,
        gated_delta_rule_recurrent_triton,
        mamba1_scan_step_triton,
        mamba2_ssd_step_triton,
    )
    from pagedserve.kernels.triton.recurrent_prefill import PREFILL_KERNELS

    return {
        **triton_ops(),
        "gated_delta_rule_recurrent": gated_delta_rule_recurrent_triton,
        "mamba2_ssd_step": mamba2_ssd_step_triton,
        "mamba1_scan_step": mamba1_scan_step_triton,
        "causal_conv1d_update": causal_conv1d_update_triton,
        **PREFILL_KERNELS,
        "gguf_linear": gguf_linear_triton,
        "lora_linear": lora_linear_triton,
        "fused_moe": fused_moe_triton,
    }


#: What the Triton kernels declare (platforms/ops.py OP_CAPABILITIES).
_TRITON_CAPABILITIES: dict[str, tuple[str, ...]] = {"gguf_linear": (GGUF_OUT_DTYPE,)}


def register_triton_ops(ops: OpRegistry, platform_name: str, names: tuple[str, ...] = TRITON_OPS) -> None:
    """Install the Triton kernels of ``names``; without triton the reference ops stay, with a warning."""
    try:
        kernels = _triton_kernels()
    except ImportError as exc:
        warnings.warn(
            f"{platform_name}: triton is not importable ({exc}); {', '.join(names)} use the slow "
            "torch reference.  Install it with `pip install triton`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    for name in names:
        ops.register(name, kernels[name], source="triton", capabilities=_TRITON_CAPABILITIES.get(name, ()))


def register_cuda_ops(ops: OpRegistry, options: GpuOptions | None = None) -> None:
    """Install the CUDA platform's kernels into ``ops`` (see the module docstring), the
    family ``options.kernels`` names (the platform's; None: read from the environment now)."""
    from pagedserve.platforms.cuda.quant_ops import register_gpu_quant_ops

    options = GpuOptions.from_env() if options is None else options
    register_gpu_quant_ops(ops, fp8_scaled_mm=True)
    if options.kernels == "triton":
        register_triton_ops(ops, "cuda")
        return
    from pagedserve.kernels.cuda import ops as cuda_ops
    from pagedserve.kernels.cuda.build import load_cuda_extension

    # Build now so that a compiler error surfaces at start-up, not in the first forward.
    load_cuda_extension()
    for name in _CUDA_CPP_OPS:
        ops.register(name, getattr(cuda_ops, name), source="cuda")
    # No CUDA C++ kernel for GGUF blocks or experts: Triton's serve them in either mode.
    register_triton_ops(
        ops, "cuda", names=("gguf_linear", "apply_token_bitmask", "lora_linear", "fused_moe", *_RECURRENT_OPS)
    )
