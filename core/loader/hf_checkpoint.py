"""Hugging Face checkpoint folders: `config.json` and safetensors weights.

Pickled checkpoints (`*.bin`, `*.pt`, `*.pth`) are refused on purpose: unpickling a file
runs arbitrary code, and every model worth serving has a safetensors export.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "find_safetensors_files",
    "iter_safetensors_weights",
    "normalize_hf_config",
    "read_eos_token_ids",
    "read_json",
    "text_weight_name",
    "VISION_PREFIXES",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object from `path`, with the file named in any parse error."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} should hold a JSON object, found {type(value).__name__}.")
    return value


def find_safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files that make up the checkpoint in `folder`, in shard order.

    A sharded checkpoint is read through its index so that stray files (an optimizer state,
    a second export) never leak in; without an index, `model.safetensors` or else every
    `*.safetensors` file is used.
    """
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no 'weight_map'.")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{str(index)!r} names shards that are missing: {', '.join(missing)}.")
        return files
    if (folder / _SINGLE_FILE).is_file():
        return [folder / _SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(
            f"Model folder {str(folder)!r} only has pickled weights ({', '.join(pickled)}). Pickled "
            "checkpoints are never loaded because unpickling can run arbitrary code; convert them to "
            "safetensors (e.g. transformers' save_pretrained(..., safe_serialization=True))."
        )
    raise FileNotFoundError(f"Model folder {str(folder)!r} holds no *.safetensors weights.")


#: Checkpoint names of the Mamba-style layout (Nemotron-H's ``backbone.*``) -> the Llama-style ones.
_BACKBONE_NAMES = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}


def canonical_name(name: str) -> str:
    """A stored tensor's name in the Llama layout every family loads (``model.embed_tokens``,
    ``model.layers.<i>.``, ``model.norm``): ``backbone.*`` checkpoints (Nemotron-H) renamed."""
    if not name.startswith("backbone."):
        return name
    name = "model." + name[len("backbone.") :]
    return _BACKBONE_NAMES.get(name, name)


def iter_safetensors_weights(files: list[pathlib.Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of `files`, in its stored dtype, on the CPU.

    Files are memory-mapped and one tensor is materialized at a time, so peak memory stays
    near the largest tensor rather than the whole checkpoint.
    """
    from safetensors import safe_open

    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"Tensor {name!r} appears in more than one shard (again in {path.name}).")
                seen.add(name)
                yield canonical_name(name), f.get_tensor(name)


def normalize_hf_config(config: dict[str, Any], weight_names: set[str] | None = None) -> dict[str, Any]:
    """`config.json` with the keys the engine reads filled in, whichever transformers wrote it.

    transformers 5 writes `rope_parameters` and `dtype` where 4.x wrote `rope_theta`,
    `rope_scaling` and `torch_dtype`; both spellings are kept, the 4.x ones always present.
    Keys a config may leave to its class default get that default.

    Args:
        config: the parsed `config.json`.
        weight_names: the checkpoint's tensor names; when given, a missing
            `tie_word_embeddings` is inferred from whether `lm_head.weight` is stored.
    """
    out = flatten_vision_language(config)
    # Nemotron-H: the layer count is the length of its per-layer mixer list.
    blocks = out.get("layers_block_type") or out.get("hybrid_override_pattern")
    if "num_hidden_layers" not in out and isinstance(blocks, (list, str)):
        out["num_hidden_layers"] = len(blocks)
    if "rms_norm_eps" not in out and "layer_norm_epsilon" in out and blocks is not None:
        out["rms_norm_eps"] = out["layer_norm_epsilon"]
    _require(out, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    if out.get("head_dim") is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out.setdefault("rms_norm_eps", 1e-6)
    out.setdefault("hidden_act", "silu")
    _normalize_rope(out)
    out.setdefault("max_position_embeddings", 2048)
    if "tie_word_embeddings" not in out:
        out["tie_word_embeddings"] = weight_names is not None and "lm_head.weight" not in weight_names
    out.setdefault("bos_token_id", None)
    out.setdefault("eos_token_id", None)
    if out.get("torch_dtype") is None:
        out["torch_dtype"] = out.get("dtype") or "float32"
    out.setdefault("architectures", None)
    return out


#: Checkpoint name prefixes of a vision-language model's non-text side (its towers and
#: projectors; Gemma 4's audio tower and embedders too), after :func:`text_weight_name`.
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "vision_model.",
    "connector.",
    "visual.",
    "image_newline",
    "embed_vision.",
    "audio_tower.",
    "embed_audio.",
)

#: Where a ``*ForConditionalGeneration`` checkpoint keeps its language model: the
#: transformers 4.x layout (``language_model.model.*``, ``language_model.lm_head``) and
#: the 5.x one (``model.language_model.*``, ``lm_head``, ``model.vision_tower.*``).
_TEXT_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
)


def text_weight_name(name: str) -> str:
    """A vision-language checkpoint's tensor name in the decoder-only spelling
    (``model.layers.0...``, ``lm_head.weight``); vision tensors lose a leading
    ``model.`` (``vision_tower.*``, ``multi_modal_projector.*``).  Other names are
    returned unchanged."""
    for old, new in _TEXT_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith("model.") and name[6:].startswith(VISION_PREFIXES):
        return name[6:]
    return name


def flatten_vision_language(config: dict[str, Any]) -> dict[str, Any]:
    """A ``*ForConditionalGeneration`` config (a ``text_config`` beside a
    ``vision_config``) as its language model's config, with everything else kept under
    ``multimodal`` (``architecture``, ``model_type``, ``vision_config``, the image token
    id...); any other config is returned as a copy."""
    text = config.get("text_config")
    if not isinstance(text, dict) or "vision_config" not in config:
        return dict(config)
    out = dict(text)
    rest = {k: v for k, v in config.items() if k != "text_config"}
    archs = config.get("architectures") or [config.get("model_type", "?")]
    rest["architecture"] = archs[0]
    out["multimodal"] = rest
    out["architectures"] = None  # the registry names the text family from model_type
    if config.get("tie_word_embeddings") is not None:  # the composite model's setting decides
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if out.get(key) is None and config.get(key) is not None:
            out[key] = config[key]
    return out


def read_eos_token_ids(folder: pathlib.Path, config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids: `generation_config.json` wins over `config.json`, as in transformers."""
    generation = folder / "generation_config.json"
    if generation.is_file():
        ids = _as_id_list(read_json(generation).get("eos_token_id"))
        if ids:
            return ids
    return _as_id_list(config.get("eos_token_id"))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _normalize_rope(config: dict[str, Any]) -> None:
    """Fill `rope_theta` and `rope_scaling` (None for plain RoPE) from either spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        config.setdefault("rope_theta", params["rope_theta"])
        if config.get("rope_scaling") is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config.setdefault("rope_theta", 10000.0)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and "rope_type" not in scaling and "type" in scaling:
        # Older configs spell it `type`; readers only need to look under one name.
        config["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
    config.setdefault("rope_scaling", None)


def _require(config: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}; is this a decoder-only language model?")
