"""Rotary-embedding cos/sin tables (default, linear, llama3, YaRN, dynamic NTK and
longrope scaling), as transformers computes them.

Dynamic NTK and longrope depend on the length of the sequence being run: transformers
recomputes the frequencies from each forward's longest position (dynamic NTK: the base
grows past the original maximum; longrope: Phi-3's long factors replace the short ones
past ``original_max_position_embeddings``).  A paged cache keeps keys rotated once, and
a batch mixes sequences of every length, so one table serves them all: the one
transformers computes for a sequence of ``max_position`` tokens, i.e. for the engine's
``max_model_len`` (vLLM's choice).  With ``max_model_len`` at most the original maximum
that is exactly the unscaled (dynamic) or short-factor (longrope) table transformers uses
for every sequence it can see; above it, sequences past the original maximum get
transformers' long-sequence frequencies and shorter ones do too (where transformers
would switch back).  docs/models.md spells out the difference.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "rope_cos_sin_cache",
    "check_rope_scaling",
    "normalize_rope_scaling",
    "mrope_section",
    "mrope_interleaved",
    "mrope_parts",
    "mrope_cos_sin",
    "SUPPORTED_ROPE_TYPES",
]

#: rope_scaling types implemented here ("default" is plain RoPE; "su" is longrope's old name).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "su")


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


def _dynamic_ntk_base(base: float, rotary_dim: int, max_position: int, scaling: dict) -> float:
    """The NTK base for sequences of ``max_position`` tokens (the original base up to the
    original maximum, then growing with the length)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    seq_len = max(max_position, original)
    return base * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def _longrope(
    inv_freq_shape: torch.Tensor, base: float, max_position: int, scaling: dict
) -> tuple[torch.Tensor, float]:
    """Phi-3's longrope: per-frequency short factors up to the original maximum, long
    ones past it, and cos/sin scaled by the attention factor in both cases."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor"] if max_position > original else scaling["short_factor"]
    if len(ext) != inv_freq_shape.numel():
        raise ValueError(
            f"longrope: {len(ext)} scaling factors for {inv_freq_shape.numel()} rotary frequencies "
            "(short_factor and long_factor need rotary_dim / 2 entries)"
        )
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**inv_freq_shape), float(attention_factor)


def normalize_rope_scaling(scaling: dict | None, hf: dict) -> tuple[dict | None, int | None]:
    """Complete ``scaling`` with the config values its table needs, as transformers reads
    them: (scaling, the model's context length when the scaling extends it, else None).

    dynamic: the original maximum is ``max_position_embeddings``; the model then serves
    ``factor`` times that (as vLLM does).  longrope: ``original_max_position_embeddings``
    (in rope_scaling or top level), ``factor`` defaulting to max / original.
    """
    rope_type = _rope_type(scaling)
    if rope_type not in ("dynamic", "longrope", "su") or scaling is None:
        return scaling, None
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        factor = float(scaling.get("factor") or 0.0)
        if factor < 1.0:
            raise ValueError(f"rope_scaling type 'dynamic' needs factor >= 1, got {factor}")
        return {**scaling, "original_max_position_embeddings": max_pos}, int(max_pos * factor)
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings")
    missing = [k for k in ("short_factor", "long_factor") if not scaling.get(k)]
    if missing:
        raise ValueError(f"rope_scaling type 'longrope' lacks {', '.join(missing)}")
    factor = scaling.get("factor") or max_pos / original
    return {**scaling, "original_max_position_embeddings": int(original), "factor": float(factor)}, None


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
    """float32 [max_position, rotary_dim]: cat(cos, sin) of each position's angles.

    Length-dependent types (dynamic, longrope) take ``max_position`` as the sequence
    length they are computed for; their ``scaling`` went through
    :func:`normalize_rope_scaling`."""
    check_rope_scaling(scaling)
    rope_type = _rope_type(scaling)
    if rope_type == "dynamic":
        base = _dynamic_ntk_base(base, rotary_dim, max_position, scaling)
    inv_freq_shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**inv_freq_shape)
    attention_factor = 1.0
    if rope_type in ("longrope", "su"):
        inv_freq, attention_factor = _longrope(inv_freq_shape, base, max_position, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(inv_freq, rotary_dim, base, max_position, scaling)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def mrope_section(hf: dict) -> list[int] | None:
    """The M-RoPE split of the rotary frequencies into (temporal, height, width) parts
    (Qwen-VL's ``mrope_section``, in ``rope_scaling`` or transformers 5's
    ``rope_parameters``); None for a plain RoPE model."""
    params = _mrope_params(hf)
    return None if params is None else [int(v) for v in params["mrope_section"]]


def mrope_interleaved(hf: dict) -> bool:
    """Whether the M-RoPE parts interleave across the frequencies (Qwen3-VL's
    ``mrope_interleaved``) instead of taking contiguous runs of them (Qwen2.5-VL)."""
    params = _mrope_params(hf)
    return bool(params is not None and params.get("mrope_interleaved"))


def _mrope_params(hf: dict) -> dict | None:
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if isinstance(params, dict) and params.get("mrope_section"):
            return params
    return None


def mrope_parts(section: list[int], interleaved: bool = False) -> list[int]:
    """Which position (0 temporal, 1 height, 2 width) each of the ``sum(section)`` rotary
    frequencies turns by.  Contiguous (Qwen2.5-VL): ``section[0]`` temporal ones, then
    ``section[1]`` height, then ``section[2]`` width.  Interleaved (Qwen3-VL): frequency
    ``j`` is height when ``j % 3 == 1`` and ``j < 3 * section[1]``, width when
    ``j % 3 == 2`` and ``j < 3 * section[2]``, temporal otherwise."""
    n = sum(section)
    if not interleaved:
        return [part for part, count in enumerate(section) for _ in range(count)]
    parts = [0] * n
    for part in (1, 2):
        for j in range(part, min(3 * section[part], n), 3):
            parts[j] = part
    return parts


def mrope_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, section: list[int], interleaved: bool = False
) -> torch.Tensor:
    """Per-token cat(cos, sin) rows [num_tokens, rotary_dim] of M-RoPE: positions int64
    [3, num_tokens] (temporal, height, width); each rotary frequency takes its angle from
    the position :func:`mrope_parts` gives it.  A plain RoPE table indexed with these
    rows and ``arange(num_tokens)`` applies M-RoPE."""
    rot = cos_sin_cache.shape[-1]
    if sum(section) != rot // 2:
        raise ValueError(f"mrope_section {section} does not add up to the {rot // 2} rotary frequencies")
    part = torch.tensor(mrope_parts(section, interleaved), dtype=torch.int64, device=positions.device)
    part = torch.cat([part, part])  # cos columns, then sin columns
    rows = cos_sin_cache[positions]  # [3, n, rot]
    return rows.gather(0, part.view(1, 1, rot).expand(1, rows.shape[1], rot)).squeeze(0)
