"""Images in chat messages: OpenAI content parts ``{"type": "image_url", "image_url":
{"url": ...}}`` (a data URI or a ``file://`` URL) and, offline, ``{"type": "image_pil",
"image_pil": image}``.  Each image part becomes the model's image placeholder text in
the message (the chat template sees text, as for a text-only model) and its image is
collected in order."""

from __future__ import annotations

from typing import Any

from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.media import check_image, load_image_url

__all__ = ["chat_images", "has_image_parts", "IMAGE_PART_TYPES"]

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def has_image_parts(contents: list[Any]) -> bool:
    """Whether any message content (a string or a list of parts) holds an image part."""
    return any(
        isinstance(c, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in c)
        for c in contents
    )


def chat_images(
    messages: list[dict[str, Any]], limits: MediaLimits, placeholder: str | None
) -> tuple[list[dict[str, Any]], list]:
    """(messages with every image part replaced by a text part holding ``placeholder``,
    the images in order).  ValueError naming the message and part of a bad image, or
    when the model takes no images (``placeholder`` None) but some are given."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if placeholder is None:
                raise ValueError(
                    f"'{where}': this model takes no images (image blocks need a supported multimodal "
                    "(vision-language) checkpoint with images on; limit_mm_per_prompt image=0 turns them off)"
                )
            try:
                images.append(_part_image(part, kind, limits))
            except ValueError as e:
                raise ValueError(f"'{where}': {e}") from None
            if len(images) > limits.max_images:
                raise ValueError(
                    f"'{where}': more than {limits.max_images} images in one request (--limit-mm-per-prompt)"
                )
            parts.append({"type": "text", "text": placeholder})
        out.append({**message, "content": parts})
    return out, images


def _part_image(part: dict, kind: str, limits: MediaLimits):
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError("image_url must be {'url': 'data:image/...;base64,...'} or a URL string")
        return load_image_url(url, limits)
    value = part.get(kind)
    return check_image(value, limits)
