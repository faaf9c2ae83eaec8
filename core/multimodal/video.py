"""Videos from requests, as frames.

Offline a video is a list of PIL images or a numpy array ``[frames, height, width, 3]``
(uint8), optionally with its frame rate: ``(frames, {"fps": 2.0})`` (default
:data:`DEFAULT_FPS`).  Chat ``video_url`` parts name a ``data:`` URI or a ``file://``
URL (under ``--allowed-local-media-path``) of an animated GIF, WebP or PNG, which Pillow
decodes (frame rate from the frames' durations).  Video containers (MP4, WebM, ...) are
not decoded: no video library is a dependency; decode the frames and send them.

Every failure is a ValueError that names the problem (a 400 in the server): too many
frames (counted from the header, before any frame is decoded), frames of different
sizes, too many pixels, an undecodable format.
"""

from __future__ import annotations

import hashlib
import io
import urllib.parse
from dataclasses import dataclass

from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.media import _check_pixels, _data_uri_bytes, _local_file_bytes, _pil, image_hash

__all__ = ["Video", "DEFAULT_FPS", "check_video", "load_video_bytes", "load_video_url", "video_list"]

#: Frames per second of a video given without its rate (transformers' Qwen-VL default).
DEFAULT_FPS = 2.0
#: Animated formats decoded from bytes (PIL's names).
VIDEO_FORMATS = ("GIF", "WEBP", "PNG")


@dataclass
class Video:
    """A video's RGB frames (one size), its frame rate and its content hash."""

    frames: list
    fps: float
    hash: str


def _video(frames: list, fps: float, limits: MediaLimits) -> Video:
    if not frames:
        raise ValueError("a video has no frames")
    if len(frames) > limits.max_video_frames:
        raise ValueError(f"a video of {len(frames)} frames; at most {limits.max_video_frames} are accepted")
    sizes = sorted({f.size for f in frames})
    if len(sizes) > 1:
        raise ValueError(f"a video's frames must share one size, got {', '.join(f'{w}x{h}' for w, h in sizes)}")
    _check_pixels(sizes[0], limits)
    frames = [f if f.mode == "RGB" else f.convert("RGB") for f in frames]
    h = hashlib.sha256(f"video:{fps!r}:{len(frames)}:".encode())
    for f in frames:
        h.update(image_hash(f).encode())
    return Video(frames, fps, h.hexdigest())


def _fps(value) -> float:
    try:
        fps = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"a video's fps must be a number, got {value!r}") from None
    if not 0 < fps < 1000:
        raise ValueError(f"a video's fps must be in (0, 1000), got {fps}")
    return fps


def _is_one_video(value) -> bool:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return True  # (frames, metadata)
    return isinstance(value, Video) or getattr(value, "ndim", None) == 4


def video_list(value) -> list:
    """The videos of ``multi_modal_data["video"]``: one video (a list of PIL images, an
    array [frames, height, width, 3], ``(frames, {"fps": ...})``) or a list of them."""
    if value is None or (isinstance(value, list) and not value):
        return []
    if isinstance(value, list) and all(_is_one_video(v) or isinstance(v, list) for v in value):
        return list(value)
    return [value]


def check_video(value, limits: MediaLimits) -> Video:
    """A video given offline (see the module docstring), checked."""
    import numpy as np

    Image = _pil().Image
    if isinstance(value, Video):
        return value
    fps = DEFAULT_FPS
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, meta = value
        unknown = sorted(set(meta) - {"fps"})
        if unknown:
            raise ValueError(f"video metadata has unknown field(s) {', '.join(unknown)} (fps only)")
        fps = _fps(meta.get("fps", DEFAULT_FPS))
    if isinstance(value, np.ndarray):
        if value.ndim != 4 or value.shape[-1] != 3 or value.dtype != np.uint8:
            raise ValueError(
                f"a video array must be uint8 [frames, height, width, 3], got {value.dtype} {list(value.shape)}"
            )
        if value.shape[0] > limits.max_video_frames:
            raise ValueError(f"a video of {value.shape[0]} frames; at most {limits.max_video_frames} are accepted")
        _check_pixels((value.shape[2], value.shape[1]), limits)
        return _video([Image.fromarray(f) for f in value], fps, limits)
    if isinstance(value, (list, tuple)) and all(isinstance(f, Image.Image) for f in value):
        return _video(list(value), fps, limits)
    raise ValueError(
        "a video must be a list of PIL images or a numpy array [frames, height, width, 3] (uint8), optionally "
        f"as (frames, {{'fps': rate}}); got {type(value).__name__} (video files are not decoded: send their frames)"
    )


def load_video_bytes(data: bytes, limits: MediaLimits) -> Video:
    """The frames of an animated GIF, WebP or PNG, checked before they are decoded."""
    PIL = _pil()
    Image = PIL.Image
    if len(data) > limits.max_bytes:
        raise ValueError(f"video is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ValueError(
            "video data is not an animated GIF, WebP or PNG (video containers such as MP4 are not decoded by this "
            "server: send the frames as an animated image, or offline as images)"
        ) from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"video is too large to decode: {e}") from None
    if image.format not in VIDEO_FORMATS:
        raise ValueError(f"video format {image.format} is not accepted (animated {', '.join(VIDEO_FORMATS)})")
    count = int(getattr(image, "n_frames", 1))
    if count > limits.max_video_frames:
        raise ValueError(f"a video of {count} frames; at most {limits.max_video_frames} are accepted")
    _check_pixels(image.size, limits)
    frames, durations = [], []
    try:
        for frame in PIL.ImageSequence.Iterator(image):
            durations.append(float(frame.info.get("duration") or 0))
            frames.append(frame.convert("RGB"))
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(f"video data is truncated or corrupt ({image.format}): {e}") from None
    mean = sum(durations) / len(durations) if durations else 0.0
    return _video(frames, _fps(1000.0 / mean) if mean > 0 else DEFAULT_FPS, limits)


def load_video_url(url: str, limits: MediaLimits) -> Video:
    """The video a ``video_url`` names: a ``data:`` URI or a ``file://`` URL under
    ``limits.allowed_local_media_path`` of an animated image; remote URLs are refused."""
    if not isinstance(url, str) or not url:
        raise ValueError("video_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        media_type = url[5:].split(",", 1)[0].split(";")[0].strip().lower()
        if not media_type.startswith("image/"):
            raise ValueError(
                f"video data of type {media_type or '(none)'!r} cannot be decoded by this server (no video "
                "library): send an animated GIF, WebP or PNG (data:image/gif;base64,...), or the frames as images"
            )
        return load_video_bytes(_data_uri_bytes(url, limits), limits)
    if scheme == "file":
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path).lower()
        if not path.endswith((".gif", ".webp", ".png", ".apng")):
            raise ValueError(
                "file:// videos must be animated GIF, WebP or PNG files (video containers such as MP4 are not "
                "decoded by this server)"
            )
        return load_video_bytes(_local_file_bytes(url, limits), limits)
    if scheme in ("http", "https"):
        raise ValueError(
            "remote video URLs are not fetched by this server; send the video inline as a data URI of an animated "
            "GIF, WebP or PNG, or as a file:// URL under --allowed-local-media-path"
        )
    raise ValueError(f"unsupported video URL scheme {scheme or url[:16]!r}: use a data: URI or a file:// URL")
