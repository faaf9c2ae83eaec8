"""Images in /v1/chat/completions and /v1/responses (``input_image`` parts) on a tiny
LLaVA: data URIs and file:// URLs (under --allowed-local-media-path) answer what
transformers answers; bad images, remote URLs, files outside the allowed folder, too many
images, unsupported ``input_image`` fields and image placeholders in /v1/completions are
400s, never 5xx.  Qwen2.5-VL and Qwen3-VL through chat (and Qwen3-VL through responses
and with a video_url part)."""

from __future__ import annotations

import base64

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from pagedserve.testing.tiny_vlm import build_llava, hf_greedy, png_bytes, png_data_uri, random_image  # noqa: E402

PROMPT = "<|im_start|>user\nWhat is this?\n<image><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llava_server(server_factory, tiny_server_args, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava-server")
    model = build_llava(folder)
    media = tmp_path_factory.mktemp("media")
    server = server_factory(
        str(folder),
        [*tiny_server_args, "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media)],
    )
    return server, model, folder, media


def _chat(server, parts, max_tokens=5, model=None):
    body = {
        "model": model or server.model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=120)


def _question(url: str) -> list[dict]:
    return [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]


def test_data_uri_and_file_url_match_transformers(llava_server):
    server, model, folder, media = llava_server
    img = random_image(41)
    _, tokens, logprobs = hf_greedy(model, folder, PROMPT, [img], 5)
    tok = __import__("transformers").AutoProcessor.from_pretrained(str(folder)).tokenizer
    for url in (png_data_uri(img), (media / "a.png").as_uri()):
        if url.startswith("file:"):
            (media / "a.png").write_bytes(png_bytes(img))
        r = _chat(server, _question(url))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == tok.decode(tokens)
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert got == pytest.approx(logprobs, abs=2e-4)


def _png_claiming(width: int, height: int) -> bytes:
    """A valid small PNG whose header claims ``width`` x ``height`` (a decompression bomb's header)."""
    import struct
    import zlib

    data = bytearray(png_bytes(random_image(1, (4, 4))))
    ihdr = 8  # after the signature: length, b"IHDR", then width, height
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4 : ihdr + 8 + 13]))
    data[ihdr + 8 + 13 : ihdr + 8 + 17] = struct.pack(">I", crc)
    return bytes(data)


def _uri(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        (_uri(b"not an image at all"), "not an image"),
        (_uri(png_bytes(random_image(2))[:60]), "truncated or corrupt"),
        (_uri(b"\x00" * 10, "gif"), "not an image"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("file:///etc/passwd", "outside --allowed-local-media-path"),
        ("ftp://x/y.png", "unsupported image URL scheme"),
    ],
)
def test_bad_images_are_400(llava_server, url, message):
    server = llava_server[0]
    r = _chat(server, _question(url))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_bomb_header_and_too_many_images_are_400(llava_server):
    server = llava_server[0]
    r = _chat(server, _question(_uri(_png_claiming(100_000, 100_000))))
    assert r.status_code == 400 and "pixels" in r.json()["error"]["message"], r.text
    url = png_data_uri(random_image(3))
    three = [{"type": "image_url", "image_url": {"url": url}} for _ in range(3)]
    r = _chat(server, three)
    assert r.status_code == 400 and "limit-mm-per-prompt" in r.json()["error"]["message"], r.text
    # The server still answers.
    assert _chat(server, _question(url), max_tokens=1).status_code == 200


def test_image_into_text_model_is_400(tiny_server):
    r = _chat(tiny_server, _question(png_data_uri(random_image(4))), model="tiny")
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text
    r = _responses(tiny_server, _input_question(png_data_uri(random_image(4))), model="tiny")
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text


def _responses(server, content, role="user", model=None, max_tokens=5):
    body = {
        "model": model or server.model,
        "input": [{"role": role, "content": content}],
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
    }
    return httpx.post(server.url + "/v1/responses", json=body, headers=server.headers(), timeout=120)


def _input_question(url: str, **extra) -> list[dict]:
    return [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url, **extra}]


def _output_text(body: dict) -> dict:
    (message,) = [item for item in body["output"] if item["type"] == "message"]
    return message["content"][0]


def test_responses_input_image_matches_transformers(llava_server):
    """input_image parts go the chat images' way: a data URI and an allowed file URL."""
    server, model, folder, media = llava_server
    img = random_image(81)
    _, tokens, logprobs = hf_greedy(model, folder, PROMPT, [img], 5)
    tok = __import__("transformers").AutoProcessor.from_pretrained(str(folder)).tokenizer
    (media / "r.png").write_bytes(png_bytes(img))
    for url, extra in ((png_data_uri(img), {"detail": "auto"}), ((media / "r.png").as_uri(), {})):
        r = _responses(server, _input_question(url, **extra))
        assert r.status_code == 200, r.text
        part = _output_text(r.json())
        assert part["text"] == tok.decode(tokens)
        assert [e["logprob"] for e in part["logprobs"]] == pytest.approx(logprobs, abs=2e-4)


@pytest.mark.parametrize(
    "content, role, message",
    [
        (_input_question("data:,", detail="high"), "user", "'high' is not supported"),
        ([{"type": "input_image", "file_id": "file-1"}], "user", "uploaded files are not supported"),
        ([{"type": "input_image", "image_url": None}], "user", "must be a non-empty string"),
        ([{"type": "input_image", "image_url": "data:,", "size": 3}], "user", "unknown field(s) size"),
        (_input_question("https://example.com/a.png"), "user", "remote image URLs are not fetched"),
        (_input_question(_uri(b"not an image")), "user", "not an image"),
        ([{"type": "input_image", "image_url": "data:,"}], "assistant", "user messages only"),
    ],
)
def test_responses_bad_input_image_is_400(llava_server, content, role, message):
    r = _responses(llava_server[0], content, role=role)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_responses_image_error_names_the_input_item(llava_server):
    """An image the chat layer refuses is named by its place in 'input' (not in the chat
    messages, which gain a system message from 'instructions')."""
    server = llava_server[0]
    body = {
        "model": server.model,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "hello"},
            {"role": "user", "content": _input_question("https://example.com/a.png")},
        ],
        "max_output_tokens": 2,
    }
    r = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input[1].content[1]"
    assert error["message"].startswith("'input[1].content[1]': remote image URLs are not fetched")


def test_completions_with_an_image_placeholder_is_400(llava_server):
    """/v1/completions takes no images: a prompt holding the image placeholder is refused."""
    server = llava_server[0]
    body = {"model": server.model, "prompt": "What is <image>?", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 400, r.text
    assert "holds the image token" in r.json()["error"]["message"]


def test_streamed_answer_equals_the_whole_one(llava_server):
    server = llava_server[0]
    parts = _question(png_data_uri(random_image(61)))
    whole = _chat(server, parts, max_tokens=6).json()["choices"][0]["message"]["content"]
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    text = ""
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = __import__("json").loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert text == whole


def test_anthropic_image_blocks(llava_server):
    """/v1/messages image blocks (base64 source) answer what the same chat request answers."""
    server = llava_server[0]
    img = random_image(71)
    whole = _chat(server, _question(png_data_uri(img)), max_tokens=5).json()["choices"][0]["message"]["content"]
    data = base64.b64encode(png_bytes(img)).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = {
        "model": server.model,
        "max_tokens": 5,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}],
    }
    r = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == whole
    bad = {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}
    body["messages"][0]["content"] = [bad]
    r = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 400 and "not fetched" in r.text, r.text


def test_qwen2_5_vl_image_url(server_factory, tiny_server_args, tmp_path_factory):
    """Qwen2.5-VL (M-RoPE positions, window-attention ViT) through the server with a data URI."""
    from pagedserve.models.qwen2_5_vl import load_qwen_vl_processor
    from pagedserve.testing.tiny_vlm import build_qwen2_5_vl, hf_greedy_qwen

    folder = tmp_path_factory.mktemp("qwen-vl-server")
    model = build_qwen2_5_vl(folder)
    server = server_factory(str(folder), list(tiny_server_args))
    img = random_image(43, (40, 52))
    prompt = "<|im_start|>user\nWhat is this?\n<|image_pad|><|im_end|>\n<|im_start|>assistant\n"
    _, tokens, logprobs = hf_greedy_qwen(model, folder, prompt, [img], 5)
    r = _chat(server, _question(png_data_uri(img)))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == load_qwen_vl_processor(str(folder)).tokenizer.decode(tokens)
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got == pytest.approx(logprobs, abs=2e-4)


def test_qwen3_vl_chat_and_responses(server_factory, tiny_server_args, tmp_path_factory):
    """Qwen3-VL (DeepStack, interleaved M-RoPE) through the server with a data URI: chat
    content parts and a /v1/responses input_image answer what transformers answers."""
    from pagedserve.models.qwen2_5_vl import load_qwen_vl_processor
    from pagedserve.testing.tiny_vlm import build_qwen3_vl, hf_greedy_qwen

    folder = tmp_path_factory.mktemp("qwen3-vl-server")
    model = build_qwen3_vl(folder)
    server = server_factory(str(folder), list(tiny_server_args))
    img = random_image(44, (52, 40))
    prompt = "<|im_start|>user\nWhat is this?\n<|image_pad|><|im_end|>\n<|im_start|>assistant\n"
    _, tokens, logprobs = hf_greedy_qwen(model, folder, prompt, [img], 5)
    text = load_qwen_vl_processor(str(folder), "Qwen3VLProcessor").tokenizer.decode(tokens)
    r = _chat(server, _question(png_data_uri(img)))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=2e-4)
    r = _responses(server, _input_question(png_data_uri(img)))
    assert r.status_code == 200, r.text
    part = _output_text(r.json())
    assert part["text"] == text
    assert [e["logprob"] for e in part["logprobs"]] == pytest.approx(logprobs, abs=2e-4)
    # A video_url part: an animated GIF (4 frames of 500 ms: temporal patches at 0.25 s and
    # 1.25 s) expands to its timestamps and video tokens; video containers are 400s.
    import io

    frames = [random_image(50 + i, (32, 24)) for i in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=500, loop=0)
    gif = "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()
    proc = load_qwen_vl_processor(str(folder), "Qwen3VLProcessor")
    grid = proc.image_processor(images=[frames[0]], return_tensors="pt")["image_grid_thw"][0]
    pads = "<|video_pad|>" * (int(grid[1] * grid[2]) // 4)
    video = "".join(f"<{t} seconds><|vision_start|>{pads}<|vision_end|>" for t in ("0.2", "1.2"))
    want = len(proc.tokenizer(prompt.replace("<|image_pad|>", video))["input_ids"])
    parts = [{"type": "text", "text": "What is this?"}, {"type": "video_url", "video_url": {"url": gif}}]
    r = _chat(server, parts, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == want
    mp4 = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
    r = _chat(server, mp4)
    assert r.status_code == 400 and "cannot be decoded" in r.json()["error"]["message"], r.text
