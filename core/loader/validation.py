"""Checks of a checkpoint's config against sane ranges and against its own tensors.

A config value that no model can have (zero heads, a NaN RoPE base, a negative norm
epsilon, 2^32 positions) or one its tensors contradict (a ``hidden_size`` or KV-head count
the projections disagree with, more layers than the file stores) would otherwise surface
much later as a ``ZeroDivisionError``, an ``AttributeError``, a ``split_with_sizes`` error,
a huge allocation or, worst, garbage tokens. ``check_config`` and ``check_tensor_shapes``
turn each into a :class:`ModelLoadError` naming the file and the field, at open time.

Both take the normalized Hugging Face config (``normalize_hf_config``/``GGUFCheckpoint.hf_config``)
and work for any architecture with the Llama tensor layout; a model registry can call them.
"""

from __future__ import annotations

import math
import pathlib
import re
from typing import Any

from pagedserve.loader.errors import ModelLoadError

__all__ = ["MAX_POSITIONS", "check_config", "check_tensor_shapes", "effective_max_model_len"]

# Positions travel as int32 (seq_lens, query_start_loc): anything beyond is corrupt metadata.
MAX_POSITIONS = 2**31 - 1
# Generous upper bounds that no real decoder comes near; past them a value is corrupt and
# would only lead to a huge allocation.
_INT_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**18),
    "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 4096),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    "max_position_embeddings": (1, MAX_POSITIONS),
}
# Default when max_model_len is not given: a RoPE table bigger than this (bytes) is refused
# with a request to pass max_model_len, rather than allocated.
_DEFAULT_ROPE_TABLE_LIMIT = 2**30
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def check_config(config: dict[str, Any], path: str | pathlib.Path) -> None:
    """Raise ModelLoadError naming ``path`` and the field if ``config`` holds an impossible value."""
    for key, (low, high) in _INT_LIMITS.items():
        value = config.get(key)
        if value is None and key == "intermediate_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(path, f"{key} must be an integer, found {value!r}")
        if not low <= value <= high:
            raise ModelLoadError(path, f"{key}={value} is outside the plausible range [{low}, {high}]")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ModelLoadError(path, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    _check_positive_float(config, "rope_theta", path)
    _check_positive_float(config, "rms_norm_eps", path, high=1.0)
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ModelLoadError(path, f"rope_scaling must be an object, found {scaling!r}")
        if "factor" in scaling:
            _check_positive_float(scaling, "factor", path, prefix="rope_scaling.")


def _check_positive_float(
    cfg: dict[str, Any], key: str, path: str | pathlib.Path, high: float = math.inf, prefix: str = ""
) -> None:
    value = cfg.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(path, f"{prefix}{key} must be a number, found {value!r}")
    if not (math.isfinite(value) and 0 < value <= high):
        raise ModelLoadError(path, f"{prefix}{key}={value!r} must be finite and in (0, {high}]")


def _per_layer_attention(config: dict[str, Any]) -> set[tuple[int, int]]:
    """(head_dim, num_key_value_heads) pairs that per-layer overrides give some layers."""
    hd, kv = config["head_dim"], config["num_key_value_heads"]
    per_layer = config.get("per_layer_config")
    overrides = list(per_layer.values()) if isinstance(per_layer, dict) else []
    if config.get("global_head_dim"):
        overrides.append(
            {"head_dim": config["global_head_dim"], "num_key_value_heads": config.get("num_global_key_value_heads")}
        )
    out = set()
    for o in overrides:
        if isinstance(o, dict):
            out.add((int(o.get("head_dim") or hd), int(o.get("num_key_value_heads") or kv)))
    return out


def expected_shapes(
    config: dict[str, Any],
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, list[tuple[int, ...]]]]:
    """(global tensor name -> shape, per-layer suffix -> shape, per-layer suffix -> the
    shapes it may have) a Llama-layout checkpoint holds."""
    hidden, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    inter = config.get("intermediate_size")
    glob = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "lm_head.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
    }
    if config.get("kv_lora_rank") is not None:  # DeepSeek MLA: q/k and v head sizes differ
        heads, qk = config["num_attention_heads"], config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        layer["self_attn.q_proj.weight"] = (heads * qk, hidden)
        layer["self_attn.o_proj.weight"] = (hidden, heads * config["v_head_dim"])
    # q/k norms are per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).
    alternatives = {"self_attn.q_norm.weight": [(hd,), (q,)], "self_attn.k_norm.weight": [(hd,), (kv,)]}
    if "linear_num_value_heads" in config:  # Qwen3.5 / Qwen3-Next gated attention: each head's query and gate
        alternatives["self_attn.q_proj.weight"] = [(2 * q, hidden)]
    # Head sizes / KV heads per layer (transformers' per_layer_config, Gemma 4's
    # global_head_dim): each layer's attention tensors may take any of the layers' shapes.
    shapes = {(hd, config["num_key_value_heads"])} | _per_layer_attention(config)
    if len(shapes) > 1:
        heads = config["num_attention_heads"]
        for name, shape_of in (
            ("self_attn.q_proj.weight", lambda d, k: (heads * d, hidden)),
            ("self_attn.k_proj.weight", lambda d, k: (k * d, hidden)),
            ("self_attn.v_proj.weight", lambda d, k: (k * d, hidden)),
            ("self_attn.o_proj.weight", lambda d, k: (hidden, heads * d)),
            ("self_attn.q_norm.weight", lambda d, k: (d,)),
            ("self_attn.k_norm.weight", lambda d, k: (d,)),
        ):
            alternatives[name] = sorted({shape_of(d, k) for d, k in shapes})
    if inter is not None:
        layer.update(
            {
                "mlp.gate_proj.weight": (inter, hidden),
                "mlp.up_proj.weight": (inter, hidden),
                "mlp.down_proj.weight": (hidden, inter),
            }
        )
        if config.get("use_double_wide_mlp"):  # Gemma 4: the KV-sharing layers' MLPs are twice as wide
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                rows, cols = layer[name]
                wide = (2 * rows, cols) if rows == inter else (rows, 2 * cols)
                alternatives[name] = [(rows, cols), wide]
    return glob, layer, alternatives


def check_tensor_shapes(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str | pathlib.Path) -> None:
    """Raise ModelLoadError if the stored tensors contradict ``config``.

    Args:
        config: the normalized config (``check_config`` passed).
        shapes: every stored tensor's name (Hugging Face spelling) -> shape, PyTorch order.
        path: the checkpoint, for the message.
    """
    glob, per_layer, alternatives = expected_shapes(config)
    layers: set[int] = set()
    for name, shape in shapes.items():
        match = _LAYER.fullmatch(name)
        if match is not None:
            layers.add(int(match.group(1)))
            wants = alternatives.get(match.group(2)) or [per_layer.get(match.group(2))]
        else:
            wants = [glob.get(name)]
        if wants[0] is not None and tuple(shape) not in wants:
            implied = " or ".join(str(list(w)) for w in wants)
            raise ModelLoadError(
                path, f"tensor {name!r} has shape {list(shape)}, but the config ({_fields_of(name)}) implies {implied}"
            )
    n = config["num_hidden_layers"]
    if layers != set(range(n)):
        found = f"layers {min(layers)}..{max(layers)} ({len(layers)} distinct)" if layers else "no layers"
        raise ModelLoadError(path, f"num_hidden_layers={n}, but the tensors hold {found}")
    if "model.embed_tokens.weight" not in shapes:
        raise ModelLoadError(path, "the checkpoint has no model.embed_tokens.weight")


def _fields_of(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "vocab_size, hidden_size"
    if "q_proj" in name or "o_proj" in name:
        return "num_attention_heads, head_dim, hidden_size"
    if "k_proj" in name or "v_proj" in name:
        return "num_key_value_heads, head_dim, hidden_size"
    if "mlp." in name:
        return "intermediate_size, hidden_size"
    if "q_norm" in name or "k_norm" in name:
        return "head_dim"
    return "hidden_size"


def effective_max_model_len(max_model_len: int | None, max_position_embeddings: int, head_dim: int) -> int:
    """The context length the engine runs with: ``max_model_len``, else the model's maximum.

    Raises ValueError when ``max_model_len`` exceeds the model's maximum, or when it is not
    given and the model's maximum would need a RoPE table over 1 GiB (a model that claims
    billions of positions): then the caller must choose a length.
    """
    if max_model_len is not None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({max_position_embeddings})"
            )
        return max_model_len
    table = max_position_embeddings * head_dim * 4
    if table > _DEFAULT_ROPE_TABLE_LIMIT:
        raise ValueError(
            f"the model declares max_position_embeddings={max_position_embeddings}, whose RoPE table "
            f"would take {table / 2**30:.1f} GiB; pass max_model_len (e.g. max_model_len=8192)"
        )
    return max_position_embeddings
