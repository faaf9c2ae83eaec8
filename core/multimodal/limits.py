"""``--limit-mm-per-prompt`` and the media size limits (no torch, no PIL)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import MODALITIES, parse_limit_mm_per_prompt

__all__ = ["MediaLimits", "parse_limit_mm_per_prompt", "MODALITIES"]


@dataclass(frozen=True)
class MediaLimits:
    """What one request's images may be.

    max_images: images per prompt (``limit_mm_per_prompt["image"]``).
    max_bytes: encoded size of one image (a data URI's decoded bytes, a file's size).
    max_pixels: width * height of one image, read from its header before any pixel is
        decoded (decompression bombs).
    allowed_local_media_path: the folder ``file://`` URLs must lie under; None refuses them.
    max_videos: videos per prompt (``limit_mm_per_prompt["video"]``).
    max_video_frames: frames of one video (each one checked as an image's pixels).
    """

    max_images: int = 4
    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    allowed_local_media_path: str | None = None
    max_videos: int = 1
    max_video_frames: int = 256
