"""The CPU's batched multi-LoRA op: the native kernel of kernels/cpu/lora.cpp for
decode-sized steps, compiled on the first LoRA step (an engine without adapters never
builds it); larger steps, or where it cannot be built, the torch reference, whose
per-adapter matmuls go to BLAS (the loader has warned why it is missing).

Measured single-threaded (4 slots, rank 48 fused qkv, 576 -> 960; docs/lora.md): the
kernel wins at 8 rows (61 vs 154 us) and loses from 32 rows on (435 vs 298 us), where a
BLAS GEMM per adapter outruns its per-tile dot products; hence NATIVE_MAX_ROWS.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import reference
from pagedserve.platforms.ops import OpRegistry

__all__ = ["register_cpu_lora_ops", "lora_linear", "NATIVE_MAX_ROWS"]

#: Steps of up to this many rows run the native kernel; larger ones the reference.
NATIVE_MAX_ROWS = 16


def lora_linear(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``reference.lora_linear``, through the native kernel for up to NATIVE_MAX_ROWS rows."""
    if x.shape[0] > NATIVE_MAX_ROWS:
        return reference.lora_linear(y, x, lora_a, lora_b, token_slots)
    from pagedserve.kernels.cpu.lora_native import load_lora_kernels

    module = load_lora_kernels()
    if module is None or y.device.type != "cpu":
        return reference.lora_linear(y, x, lora_a, lora_b, token_slots)
    return module.lora_linear(y, x, lora_a, lora_b, token_slots)


def register_cpu_lora_ops(ops: OpRegistry) -> None:
    ops.register("lora_linear", lora_linear, source="cpu-native-lora")
