"""The CPU's mixture-of-experts ops: ``fused_moe`` through the native kernel of
kernels/cpu/moe.cpp (tokens grouped by expert, one GEMM per active expert for w13 and one
for w2, OpenMP across experts and column tiles), and ``prepare_moe_weights``, which packs
bf16 expert weights once at load into the layout of the packed bf16 micro-kernels
(``[E, N/16, K/2, 16, 2]``, each expert as ``NativeCpuKernels.pack_linear_weight``
packs a dense weight).

The kernel is compiled on first use (a model without experts never builds it).  Inputs
it does not take (other devices or dtypes, mismatched dtypes, activations other than
silu/gelu) and machines where it cannot be built run the torch reference, on the
unpacked weights when they were packed.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import reference
from pagedserve.platforms.ops import OpRegistry

__all__ = [
    "ACTIVATIONS",
    "SOURCE",
    "fused_moe",
    "pack_expert_weight",
    "prepare_moe_weights",
    "register_cpu_moe_ops",
    "unpack_expert_weight",
]

SOURCE = "cpu-native-moe"
#: Activation name -> the kernel's code (reference.fused_moe's names).
ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu": 1, "swigluoai": 2}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from pagedserve.kernels.cpu.moe_native import load_moe_kernels

    return load_moe_kernels()


def pack_expert_weight(w: torch.Tensor) -> torch.Tensor | None:
    """bf16 [E, N, K] -> [E, N/16, K/2, 16, 2] (per expert, the VNNI pairs of the packed
    linear kernel), or None where N % 16 or K % 2 is not 0."""
    e, n, k = w.shape
    if n % 16 or k % 2 or w.numel() == 0:
        return None
    return w.contiguous().view(e, n // 16, 16, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


def unpack_expert_weight(w: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_expert_weight; a plain [E, N, K] weight is returned as it is."""
    if w.dim() != 5:
        return w
    e, nb, kp = w.shape[:3]
    return w.permute(0, 1, 3, 2, 4).reshape(e, nb * 16, kp * 2)


def prepare_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.prepare_moe_weights: bf16 CPU expert weights packed for the native
    kernel where it has the packed micro-kernels (AVX-512 BF16) and the shape fits; each
    of the two independently, anything else unchanged."""
    module = _kernels()
    if module is None or not module.has_packed():
        return w13, w2

    def pack(w: torch.Tensor) -> torch.Tensor:
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 3:
            return w
        packed = pack_expert_weight(w)
        return w if packed is None else packed

    return pack(w13), pack(w2)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """See reference.fused_moe (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights
    [T, K], topk_ids int64 [T, K]; either weight may be packed by prepare_moe_weights).

    GPT-OSS's experts (biases w13_bias [E, 2I] and w2_bias [E, H], "swigluoai") run
    natively on plain expert weights; packed ones take the reference for them."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not supported (silu, gelu, swigluoai)")
    oai = w13_bias is not None or w2_bias is not None or activation == "swigluoai"
    module = _kernels()
    packed = w13.dim() == 5 or w2.dim() == 5
    if (
        module is None
        or x.dim() != 2
        or x.dtype not in _DTYPES
        or w13.dtype != x.dtype
        or w2.dtype != x.dtype
        or x.device.type != "cpu"
        or w13.device.type != "cpu"
        or w2.device.type != "cpu"
        or (packed and (x.dtype != torch.bfloat16 or not module.has_packed() or oai))
    ):
        w13, w2 = unpack_expert_weight(w13).to(x.dtype), unpack_expert_weight(w2).to(x.dtype)
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, alpha, limit)
    return module.fused_moe(
        x.contiguous(),
        w13.contiguous(),
        w2.contiguous(),
        topk_weights.to(device="cpu", dtype=torch.float32).contiguous(),
        topk_ids.to(device="cpu", dtype=torch.int64).contiguous(),
        ACTIVATIONS[activation],
        None if w13_bias is None else w13_bias.to(x.dtype).contiguous(),
        None if w2_bias is None else w2_bias.to(x.dtype).contiguous(),
        float(alpha),
        float(limit),
    )


def register_cpu_moe_ops(ops: OpRegistry, prepack: bool = True) -> None:
    """Install ``fused_moe`` and, with ``prepack`` (PAGEDSERVE_CPU_PREPACK), ``prepare_moe_weights``."""
    ops.register("fused_moe", fused_moe, source=SOURCE)
    if prepack:
        ops.register("prepare_moe_weights", prepare_moe_weights, source=SOURCE)
