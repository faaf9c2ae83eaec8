"""``speculative_config``: which proposer drafts tokens and how many.

Spelled as vLLM spells it: a JSON object (``--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4}'``) or a dict (``LLM(speculative_config={...})``).  Keys:

- ``method``: ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with the same
  vocabulary, given by ``model``) or ``self_quantized`` (the target checkpoint's quantized
  copy drafts for its float weights; ``quantization`` names the draft's method, default
  ``gguf``).  Without ``method``, ``model`` means ``draft_model`` (vLLM's inference).
- ``num_speculative_tokens``: tokens proposed per step, 1 to ``MAX_SPECULATIVE_TOKENS``.
- ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram sizes matched (ngram only).
- ``draft_tensor_parallel_size`` (draft_model only): 1 (the default) loads the draft
  whole in the engine's process; the target's ``tensor_parallel_size`` shards it over
  the same ranks as the target, its KV cache beside the target's.

Every key is checked here, before any model is opened; an unknown key is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "SpeculativeConfig",
    "METHODS",
    "MAX_SPECULATIVE_TOKENS",
    "parse_speculative_config",
    "speculative_config_arg",
]

#: Proposers by name; EAGLE/MTP-style heads would be added here (and in proposer.py).
METHODS: tuple[str, ...] = ("ngram", "draft_model", "self_quantized")
#: Most tokens one step may propose per request (verification widens every row by it).
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked ``speculative_config``."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    quantization: str | None = None  # the draft's (self_quantized: gguf; draft_model: auto)
    draft_tensor_parallel_size: int | None = None  # None: 1 (whole, in the engine's process)

    @property
    def draft_tp(self) -> int:
        """Ranks the draft model is sharded over (1: whole in the engine's process)."""
        return self.draft_tensor_parallel_size or 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _int(d: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config: {key} must be an integer, got {value!r}")
    return value


def parse_speculative_config(value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON string or one already parsed (None stays
    None); ValueError naming the bad key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON ({e.msg}): {value!r}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object or a dict, got {type(value).__name__}")
    d = dict(value)
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    method = d.get("method") or ("draft_model" if d.get("model") else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
    k = _int(d, "num_speculative_tokens", None)
    if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config: num_speculative_tokens must be an integer in "
            f"[1, {MAX_SPECULATIVE_TOKENS}], got {d.get('num_speculative_tokens')!r}"
        )
    lo, hi = _int(d, "prompt_lookup_min", 1), _int(d, "prompt_lookup_max", None)
    if hi is None:
        hi = max(lo, 4)
    if method == "ngram":
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
    elif "prompt_lookup_min" in d or "prompt_lookup_max" in d:
        raise ValueError(f"speculative_config: prompt_lookup_min/max apply to method 'ngram', not {method!r}")
    model = d.get("model")
    if method == "draft_model" and not model:
        raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint folder or .gguf file)")
    if method != "draft_model" and model:
        raise ValueError(f"speculative_config: 'model' applies to method 'draft_model', not {method!r}")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config: model must be a path string, got {model!r}")
    quant = d.get("quantization")
    if method == "self_quantized":
        quant = quant or "gguf"
        if quant in ("none", "auto"):
            raise ValueError(
                f"speculative_config: method 'self_quantized' drafts with quantized weights; "
                f"quantization={quant!r} would draft with the target's own weights"
            )
    elif method == "ngram" and quant is not None:
        raise ValueError("speculative_config: quantization applies to a draft model, not to method 'ngram'")
    draft_tp = _int(d, "draft_tensor_parallel_size", None)
    if draft_tp is not None:
        if method != "draft_model":
            raise ValueError(f"speculative_config: draft_tensor_parallel_size applies to 'draft_model', not {method!r}")
        if draft_tp < 1:
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be >= 1, got {draft_tp}")
    return SpeculativeConfig(method, k, model, lo, hi, quant, draft_tp)


def speculative_config_arg(value: str) -> SpeculativeConfig:
    """The ``--speculative-config`` flag's converter (ValueError becomes argparse's error)."""
    out = parse_speculative_config(value)
    assert out is not None
    return out
