"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32) expert
weights of GPT-OSS checkpoints, dequantized at load.

Checkpoint layout (as the released GPT-OSS safetensors): ``<name>_blocks`` uint8
[..., rows, cols / 32, 16] holds 32 FP4 codes per block, two per byte (the element at
the even position in the low nibble), and ``<name>_scales`` uint8 [..., rows, cols / 32]
holds each block's E8M0 exponent (2 ** (s - 127)).  An E2M1 code is sign (bit 3),
exponent (bits 2-1), mantissa (bit 0): 0.5 * m when the exponent is 0 (subnormal),
else 2 ** (e - 1) * (1 + m / 2), so the magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "dequantize_mxfp4"]

#: The 16 E2M1 codes' values, in code order.
E2M1_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16] and scales uint8 [..., rows, G] -> [..., rows, G * 32]
    in ``dtype``.  Every FP4 value times a power of two is exact in bf16 unless the scale
    leaves bf16's exponent range; the E8M0 NaN code (255) is refused."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
            "expected blocks [..., G, 16] and scales [..., G]"
        )
    if bool((scales == 255).any()):
        raise ValueError("MXFP4 scales hold the E8M0 NaN code (255)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    out = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.flatten(-2).to(dtype)
