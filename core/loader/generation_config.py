"""Sampling defaults from a checkpoint's ``generation_config.json`` (vLLM's
``--generation-config``): ``"auto"`` reads the model folder's file, ``"ignore"`` uses
none, any other value is a folder holding the file.  Request fields left unset take
these values; fields a request sets win."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

__all__ = ["load_generation_defaults", "GENERATION_KEYS"]

#: generation_config.json key -> SamplingParams field.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(setting: str, model_path: pathlib.Path | None) -> dict[str, Any]:
    """SamplingParams keyword defaults; ValueError for a bad setting or file."""
    if setting == "ignore":
        return {}
    if setting == "auto":
        if model_path is None or not model_path.is_dir():
            return {}  # a .gguf file carries no generation_config.json
        folder = model_path
    else:
        folder = pathlib.Path(setting)
        if not folder.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'ignore' or a folder, got {setting!r}")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    out: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out
