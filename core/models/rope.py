"""Rotary-embedding cos/sin tables (default and llama3 scaling), as transformers computes them."""

from __future__ import annotations

import math

import torch

__all__ = ["rope_cos_sin_cache", "check_rope_scaling", "SUPPORTED_ROPE_TYPES"]

#: rope_scaling types implemented here ("default" is plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"


def check_rope_scaling(scaling: dict | None) -> None:
    """ValueError naming a rope_scaling type that is not implemented."""
    rope_type = _rope_type(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)})")


def rope_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> torch.Tensor:
    """float32 [max_position, rotary_dim]: cat(cos, sin) of each position's angles."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    check_rope_scaling(scaling)
    rope_type = _rope_type(scaling)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
