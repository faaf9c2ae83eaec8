"""Multimodal inputs: images given to ``LLM.generate``/``LLM.chat`` or in chat content
parts, checked and decoded (:mod:`.media`), expanded into image tokens by the
checkpoint's own transformers processor (:mod:`.processor`), and their vision-encoder
outputs cached while a prompt is prefilled (:mod:`.encoder_cache`).  docs/multimodal.md."""

from pagedserve.multimodal.limits import MediaLimits, parse_limit_mm_per_prompt
from pagedserve.multimodal.media import MultiModalItem, image_hash, load_image_bytes, load_image_url

__all__ = [
    "MediaLimits",
    "MultiModalItem",
    "image_hash",
    "load_image_bytes",
    "load_image_url",
    "parse_limit_mm_per_prompt",
]
