"""Image intake without a model: sizes checked before decoding, formats, truncation,
URL schemes and the local-media root, --limit-mm-per-prompt parsing, image hashes in
prefix-cache keys, and the vision ops against independent computations."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
import torch

from pagedserve.config import parse_limit_mm_per_prompt
from pagedserve.kernels import reference
from pagedserve.kv_cache.block_hash import block_hashes
from pagedserve.multimodal import MediaLimits, image_hash, load_image_bytes, load_image_url
from pagedserve.multimodal.processor import _split_runs, image_token_runs

pytest.importorskip("PIL")
from pagedserve.testing.tiny_vlm import png_bytes, random_image  # noqa: E402


def _png_claiming(width: int, height: int) -> bytes:
    data = bytearray(png_bytes(random_image(1, (4, 4))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_decodes_and_hashes_pixels():
    img = random_image(5)
    got = load_image_bytes(png_bytes(img), MediaLimits())
    assert got.size == img.size and image_hash(got) == image_hash(img)
    assert image_hash(random_image(6)) != image_hash(img)
    jpeg = __import__("io").BytesIO()
    img.save(jpeg, format="JPEG")
    assert load_image_bytes(jpeg.getvalue(), MediaLimits()).mode == "RGB"


def test_pixel_limit_is_checked_before_decoding(monkeypatch):
    bomb = _png_claiming(60_000, 60_000)  # 3.6e9 pixels claimed by a ~100-byte file
    loaded = []
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loaded.append(1))
    with pytest.raises(ValueError, match="pixels"):
        load_image_bytes(bomb, MediaLimits())
    assert not loaded  # refused from the header alone
    with pytest.raises(ValueError, match="pixels"):
        load_image_bytes(png_bytes(random_image(1, (20, 20))), MediaLimits(max_pixels=100))


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"hello world", "not an image"),
        (b"", "not an image"),
        (b"x" * 200, "at most 100 are accepted"),
    ],
)
def test_bad_bytes(raw, message):
    with pytest.raises(ValueError, match=message):
        load_image_bytes(raw, MediaLimits(max_bytes=100) if len(raw) > 100 else MediaLimits())


def test_truncated_png():
    raw = png_bytes(random_image(7, (64, 64)))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_image_bytes(raw[: len(raw) // 2], MediaLimits())


def test_urls(tmp_path):
    img = random_image(8)
    raw = png_bytes(img)
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert image_hash(load_image_url(uri, MediaLimits())) == image_hash(img)
    with pytest.raises(ValueError, match="over 10 bytes"):
        load_image_url(uri, MediaLimits(max_bytes=10))
    with pytest.raises(ValueError, match="remote image URLs are not fetched"):
        load_image_url("http://example.com/a.png", MediaLimits())
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(raw)
    (tmp_path / "b.png").write_bytes(raw)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        load_image_url((root / "a.png").as_uri(), MediaLimits())
    limits = MediaLimits(allowed_local_media_path=str(root))
    assert image_hash(load_image_url((root / "a.png").as_uri(), limits)) == image_hash(img)
    for outside in ((tmp_path / "b.png").as_uri(), "file://" + str(root) + "/../b.png"):
        with pytest.raises(ValueError, match="outside"):
            load_image_url(outside, limits)
    with pytest.raises(ValueError, match="does not exist"):
        load_image_url((root / "none.png").as_uri(), limits)


def test_limit_mm_per_prompt_spellings():
    assert parse_limit_mm_per_prompt('{"image": 2}') == {"image": 2}
    assert parse_limit_mm_per_prompt("image=0") == {"image": 0}
    assert parse_limit_mm_per_prompt({"image": 3}) == {"image": 3}
    assert parse_limit_mm_per_prompt(None) is None
    assert parse_limit_mm_per_prompt("image=1,video=2") == {"image": 1, "video": 2}
    for bad, message in (('{"audio": 1}', "unknown modality"), ("image=-1", ">= 0"), ("image", "use JSON")):
        with pytest.raises(ValueError, match=message):
            parse_limit_mm_per_prompt(bad)


def test_image_runs_split_per_image():
    ids = [5, 9, 9, 9, 9, 6, 9, 9]
    assert image_token_runs(ids, 9) == [(1, 4), (6, 2)]
    assert _split_runs([(1, 4)], 2) == [(1, 2), (3, 2)]
    assert _split_runs([(1, 3)], 2) is None


def test_block_hashes_key_on_image_content():
    tokens = [3] * 4 + [9] * 8 + [4] * 4
    a = block_hashes(tokens, 4, 4)
    spans_x, spans_y = ((4, 8, "x"),), ((4, 8, "y"),)
    hx = block_hashes(tokens, 4, 4)  # no spans: what a text-only prompt gets
    assert a == hx
    from pagedserve.kv_cache.block_hash import extend_block_hashes

    x = extend_block_hashes([], tokens, 4, 4, None, spans_x)
    y = extend_block_hashes([], tokens, 4, 4, None, spans_y)
    assert x[0] == y[0] == a[0]  # the block before the image is shared
    assert x[1][0] != y[1][0] and x[3][0] != y[3][0]  # the image's blocks and every later one differ
    assert extend_block_hashes([], tokens, 4, 4, None, spans_x) == x


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_encoder_attention_matches_sdpa(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 17]
    heads, hd = 3, 16
    q, k, v = (torch.randn(sum(lens), heads, hd, generator=gen).to(dtype) for _ in range(3))
    cu = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    out = reference.encoder_attention(q, k, v, cu, 0.3)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[sl].float().transpose(0, 1), k[sl].float().transpose(0, 1), v[sl].float().transpose(0, 1), scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[sl].float(), want, atol=tol, rtol=tol)
        start += n


def test_quick_gelu():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(reference.quick_gelu(x), x * torch.sigmoid(1.702 * x))
