"""The text decoder of a multimodal checkpoint, loaded as its causal-LM architecture.

A ``*ForConditionalGeneration`` folder keeps the decoder's settings under ``text_config``
and its tensors under a prefix (``model.language_model.``) beside the vision and audio
towers.  For the wrappers listed here the loader reads ``text_config`` as the config
(architecture: the causal LM's), strips the prefix and leaves every other tower's tensor
unread; the engine then serves text prompts exactly as the causal LM would.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TEXT_PARTS", "text_part", "text_weight_name"]

#: Wrapper architecture -> (causal-LM architecture, prefix of the decoder's tensors).
TEXT_PARTS: dict[str, tuple[str, str]] = {
    "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", "model.language_model."),
}


def text_part(config: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(the decoder's config, its tensors' prefix) for a wrapper of :data:`TEXT_PARTS`,
    else None.  A wrapper without ``text_config`` is a ValueError naming it."""
    archs = config.get("architectures") or []
    entry = TEXT_PARTS.get(archs[0]) if archs else None
    if entry is None:
        return None
    causal, prefix = entry
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{archs[0]}: config.json has no text_config to load the text decoder from")
    out = {**text, "architectures": [causal]}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if out.get(key) is None and config.get(key) is not None:
            out[key] = config[key]
    return out, prefix


def text_weight_name(name: str, prefix: str) -> str | None:
    """The causal LM's name for stored tensor ``name``, or None for another tower's."""
    if name.startswith(prefix):
        return "model." + name[len(prefix) :]
    return name if name == "lm_head.weight" else None
