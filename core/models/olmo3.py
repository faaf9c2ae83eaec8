"""OLMo 3: OLMo 2's post-norm layers and whole-projection q/k norms, with sliding-window
attention on the layers ``layer_types`` marks (by default three of every four) and a RoPE
per layer type: transformers 5 keeps ``rope_parameters`` as ``{"full_attention": {...},
"sliding_attention": {...}}``, each with its own base and scaling (YaRN on the full
layers of the long-context checkpoints).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.layers import RotaryEmbedding, layer_windows
from pagedserve.models.olmo2 import Olmo2ForCausalLM
from pagedserve.models.rope import check_rope_scaling, normalize_rope_scaling

__all__ = ["Olmo3ForCausalLM", "per_layer_type_rope"]

#: transformers' Olmo3Config.default_theta.
_DEFAULT_THETA = 500_000.0


def per_layer_type_rope(hf: dict[str, Any], default_theta: float) -> dict[str, tuple[float, dict | None]]:
    """{"full_attention": (theta, scaling), "sliding_attention": (theta, scaling)} from
    transformers 5's per-layer-type ``rope_parameters``, or from flat ``rope_theta`` /
    ``rope_scaling`` (the scaling then applies to the full-attention layers only, as
    transformers converts it)."""
    params = hf.get("rope_parameters")
    out = {}
    for kind in ("full_attention", "sliding_attention"):
        if isinstance(params, dict) and isinstance(params.get(kind), dict):
            p = params[kind]
            theta = float(p.get("rope_theta", default_theta))
            scaling = p if (p.get("rope_type") or p.get("type") or "default") != "default" else None
        else:
            theta = float(hf.get("rope_theta") or default_theta)
            scaling = hf.get("rope_scaling") if kind == "full_attention" else None
        out[kind] = (theta, normalize_rope_scaling(scaling, hf)[0])
    return out


def _with_layer_types(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``hf`` with transformers' default ``layer_types`` when it has none: sliding
    attention except on every fourth layer."""
    if hf.get("layer_types") is not None:
        return hf
    types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    return {**hf, "layer_types": types}


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        DecoderForCausalLM.check_config(cfg)
        if cfg.attention_bias:
            raise ValueError("Olmo3ForCausalLM: attention_bias=true is not supported")
        # Unknown layer types fail here by name.
        layer_windows(_with_layer_types(cfg.hf_config, cfg.num_layers), cfg.num_layers)
        for _, scaling in per_layer_type_rope(cfg.hf_config, _DEFAULT_THETA).values():
            check_rope_scaling(scaling)

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.layer_types = _with_layer_types(cfg.hf_config, cfg.num_layers)["layer_types"]
        self.windows = layer_windows({**cfg.hf_config, "layer_types": self.layer_types}, cfg.num_layers)

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding:
        ropes = per_layer_type_rope(self.cfg.hf_config, _DEFAULT_THETA)
        dim, pos = self.rotary_dim(), self.max_positions
        theta, scaling = ropes["sliding_attention"]
        self.local_rope = RotaryEmbedding(dim, pos, theta, scaling, devices)
        theta, scaling = ropes["full_attention"]
        return RotaryEmbedding(dim, pos, theta, scaling, devices)

    def window_of(self, index: int) -> int | None:
        return self.windows[index]

    def rope_for(self, index: int) -> RotaryEmbedding:
        # By layer type: a window as long as the context is no window, but keeps its RoPE.
        return self.local_rope if self.layer_types[index] == "sliding_attention" else self.rope
