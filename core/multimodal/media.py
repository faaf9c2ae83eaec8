"""Images from requests: PIL images given offline, or the bytes of a data URI or a local
file, checked before they are decoded.

Every failure is a ValueError that names the problem (the server answers it with a 400):
too many bytes, too many pixels (read from the header, before any pixel is decoded, so
a decompression bomb costs nothing), a format PIL cannot identify, a truncated file, a
remote URL (nothing is fetched), a ``file://`` path outside ``--allowed-local-media-path``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pathlib
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from pagedserve.multimodal.limits import MediaLimits

__all__ = ["MultiModalItem", "image_hash", "check_image", "load_image_bytes", "load_image_url"]

#: Formats accepted from bytes (PIL's names).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


@dataclass
class MultiModalItem:
    """One image of a prompt, after the processor.

    offset, length: where its image tokens are in the prompt (``[offset, offset+length)``).
    hash: the image's content hash (sha256 hex): the encoder cache's key and a
        prefix-cache key of every KV block its tokens touch.
    data: what the vision model reads (e.g. ``pixel_values`` [1, 3, H, W]).
    """

    modality: str
    offset: int
    length: int
    hash: str
    data: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(image) -> str:
    """sha256 of a PIL image's mode, size and pixels (two encodings of the same pixels
    hash the same)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _pil():
    """The PIL package (Pillow), or a RuntimeError that says how to install it."""
    try:
        import PIL.Image
    except ImportError as e:
        raise RuntimeError("images need Pillow: pip install 'pagedserve[multimodal]'") from e
    return PIL


def check_image(image, limits: MediaLimits):
    """A PIL image given directly (offline API): its pixel count checked; returned as RGB."""
    Image = _pil().Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    _check_pixels(image.size, limits)
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_pixels(size: tuple[int, int], limits: MediaLimits) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"image has no pixels ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ValueError(f"image is {w}x{h} = {w * h} pixels; at most {limits.max_pixels} are accepted")


def load_image_bytes(data: bytes, limits: MediaLimits):
    """Decode an encoded image (PNG, JPEG, ...) into an RGB PIL image, checking its size
    and pixel count first."""
    Image = _pil().Image
    UnidentifiedImageError = Image.UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ValueError(f"image is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise ValueError(f"image data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image is too large to decode: {e}") from None
    if image.format not in IMAGE_FORMATS:
        raise ValueError(f"image format {image.format} is not accepted (supported: {', '.join(IMAGE_FORMATS)})")
    _check_pixels(image.size, limits)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image data is truncated or corrupt ({image.format}): {e}") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image_url(url: str, limits: MediaLimits):
    """The image an ``image_url`` names: a ``data:image/...;base64,`` URI or a
    ``file://`` URL under ``limits.allowed_local_media_path``; remote URLs are refused."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return load_image_bytes(_data_uri_bytes(url, limits), limits)
    if scheme == "file":
        return load_image_bytes(_local_file_bytes(url, limits), limits)
    if scheme in ("http", "https"):
        raise ValueError(
            "remote image URLs are not fetched by this server; send the image inline as a data URI "
            "(data:image/png;base64,...) or as a file:// URL under --allowed-local-media-path"
        )
    raise ValueError(f"unsupported image URL scheme {scheme or url[:16]!r}: use a data: URI or a file:// URL")


def _data_uri_bytes(url: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("data URI has no ',' before its payload")
    media_type = header[5:].split(";")[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ValueError(f"data URI media type {media_type or '(none)'!r} is not an image type")
    if ";base64" not in header.lower():
        raise ValueError("only base64 data URIs are accepted for images")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:  # before decoding anything
        raise ValueError(f"image is over {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URI payload is not valid base64: {e}") from None


def _local_file_bytes(url: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise ValueError("file:// image URLs need the server to be started with --allowed-local-media-path")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file URL host {parsed.netloc!r} is not local")
    path = pathlib.Path(urllib.parse.unquote(parsed.path)).resolve()
    base = pathlib.Path(root).resolve()
    if not path.is_relative_to(base):
        raise ValueError(f"file {str(path)!r} is outside --allowed-local-media-path {str(base)!r}")
    if not path.is_file():
        raise ValueError(f"file {str(path)!r} does not exist or is not a file")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise ValueError(f"image file is {size} bytes; at most {limits.max_bytes} are accepted")
    return path.read_bytes()
