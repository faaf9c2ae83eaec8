"""Read and check a PEFT LoRA adapter folder against the base model's shapes.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``...) and ``adapter_model.safetensors`` with, per targeted linear,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r].  The delta of a linear is ``scale * B @ A`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA); it is folded into
B here.  Everything a served adapter could get wrong is a ValueError naming the file
and the field: the engine never half-applies an adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["LoRAAdapter", "load_adapter", "TARGET_MODULES", "module_shapes"]

#: The linears an adapter may target, by PEFT name: their block (attention or MLP).
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# Settings whose non-default value changes what the adapter computes, and we do not do.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, [], ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
}


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per layer, per PEFT module name, (A [r, in], B [out, r])
    in float32 with the scaling folded into B."""

    path: str
    rank: int
    scaling: float
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def target_modules(self) -> set[str]:
        return {m for mods in self.weights.values() for m in mods}

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for mods in self.weights.values() for a, b in mods.values())


def module_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable linear of the (unsharded) base model."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise ValueError(f"LoRA adapter path {str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, defaults in _UNSUPPORTED.items():
        if cfg.get(key, defaults[0]) not in defaults:
            raise ValueError(f"{cfg_file}: {key}={cfg[key]!r} is not supported")
    return cfg


def _scaling(cfg: dict, cfg_file: Path, max_rank: int) -> tuple[int, float]:
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{cfg_file}: field 'r' must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{cfg_file}: LoRA rank r={r} exceeds max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{cfg_file}: field 'lora_alpha' must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def load_adapter(path: str | Path, arch: Any, max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at ``path`` and check it fits ``arch`` (an ArchConfig).

    ValueError naming the file and field for: a missing file, unsupported settings, a
    rank above ``max_rank``, a target module the model has not, a layer past the model's,
    or a tensor shaped for another base model.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg = _read_config(path)
    cfg_file = path / "adapter_config.json"
    rank, scale = _scaling(cfg, cfg_file, max_rank)
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - TARGET_MODULES.keys())
        if unknown:
            raise ValueError(
                f"{cfg_file}: target_modules {unknown} are not supported; supported: {', '.join(TARGET_MODULES)}"
            )
    st = path / "adapter_model.safetensors"
    if not st.is_file():
        raise ValueError(
            f"LoRA adapter {str(path)!r} has no adapter_model.safetensors"
            + (" (adapter_model.bin is not supported)" if (path / "adapter_model.bin").exists() else "")
        )
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(st), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise ValueError(
                        f"{st}: tensor {key!r} is not a LoRA weight of a supported module ({', '.join(TARGET_MODULES)})"
                    )
                layer, block, name, half = int(m[1]), m[2], m[3], m[4]
                if TARGET_MODULES.get(name) != block:
                    raise ValueError(f"{st}: tensor {key!r} targets unknown module {block}.{name}")
                if layer >= arch.num_layers:
                    raise ValueError(
                        f"{st}: tensor {key!r} is for layer {layer}; the base model has {arch.num_layers} layers"
                    )
                halves.setdefault((layer, name), {})[half] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"{st}: cannot be read as safetensors ({exc})") from None
    adapter = LoRAAdapter(str(path), rank, scale)
    for (layer, name), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{st}: layer {layer} {name} has lora_{next(iter(ab))} without its other half")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[name]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(
                f"{st}: layer {layer} {name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit the base model (expected ({rank}, {fan_in}) / ({fan_out}, {rank})): an adapter "
                "for another base model?"
            )
        adapter.weights.setdefault(layer, {})[name] = (a.contiguous(), (b * scale).contiguous())
    if not adapter.weights:
        raise ValueError(f"{st}: holds no LoRA weights")
    return adapter
