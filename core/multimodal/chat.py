"""Images and videos in chat messages: OpenAI content parts ``{"type": "image_url",
"image_url": {"url": ...}}`` (a data URI or a ``file://`` URL) and, offline, ``{"type":
"image_pil", "image_pil": image}``; vLLM's ``{"type": "video_url", "video_url": {"url":
...}}`` (an animated GIF, WebP or PNG: :mod:`.video`).  Each part becomes the model's
placeholder text in the message (the chat template sees text, as for a text-only
model) and its image or video is collected in order."""

from __future__ import annotations

from typing import Any

from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.media import check_image, load_image_url
from pagedserve.multimodal.video import load_video_url

__all__ = ["chat_images", "chat_media", "has_image_parts", "IMAGE_PART_TYPES", "VIDEO_PART_TYPES"]

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
VIDEO_PART_TYPES = ("video_url",)


def has_image_parts(contents: list[Any]) -> bool:
    """Whether any message content (a string or a list of parts) holds an image or a
    video part."""
    kinds = IMAGE_PART_TYPES + VIDEO_PART_TYPES
    return any(isinstance(c, list) and any(isinstance(p, dict) and p.get("type") in kinds for p in c) for c in contents)


def chat_media(
    messages: list[dict[str, Any]], limits: MediaLimits, placeholder: str | None, video_placeholder: str | None
) -> tuple[list[dict[str, Any]], list, list]:
    """(messages with every image and video part replaced by a text part holding its
    placeholder, the images in order, the videos in order).  ValueError naming the
    message and part of a bad image or video, or when the model takes none
    (``placeholder`` / ``video_placeholder`` None) but some are given."""
    out, images, videos = [], [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in VIDEO_PART_TYPES:
                if video_placeholder is None:
                    raise ValueError(f"'{where}': this model takes no videos")
                value = part.get("video_url")
                url = value.get("url") if isinstance(value, dict) else value
                try:
                    videos.append(load_video_url(url, limits))
                except ValueError as e:
                    raise ValueError(f"'{where}': {e}") from None
                if len(videos) > limits.max_videos:
                    raise ValueError(
                        f"'{where}': more than {limits.max_videos} videos in one request "
                        "(--limit-mm-per-prompt video=N)"
                    )
                parts.append({"type": "text", "text": video_placeholder})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    out, images = chat_images(out, limits, placeholder)
    return out, images, videos


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
