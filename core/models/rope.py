"""Rotary-embedding cos/sin tables (default, linear, llama3 and YaRN scaling), as transformers
computes them.  Length-dependent scalings (dynamic NTK, longrope) are refused by name: a
paged batch mixes sequences of every length, so one table cannot serve them exactly."""

from __future__ import annotations

import math

import torch

__all__ = ["rope_cos_sin_cache", "check_rope_scaling", "SUPPORTED_ROPE_TYPES"]

#: rope_scaling types implemented here ("default" is plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def _yarn(
    inv_freq: torch.Tensor, rotary_dim: int, base: float, max_position: int, scaling: dict
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, ramp in
    between; returns (inv_freq, the factor cos and sin are multiplied by)."""
    factor = scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]
    original = scaling.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"


def check_rope_scaling(scaling: dict | None) -> None:
    """ValueError naming a rope_scaling type that is not implemented."""
    rope_type = _rope_type(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """float32 [max_position, rotary_dim]: cat(cos, sin) of each position's angles."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    check_rope_scaling(scaling)
    rope_type = _rope_type(scaling)
    attention_factor = 1.0
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn(inv_freq, rotary_dim, base, max_position, scaling)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
