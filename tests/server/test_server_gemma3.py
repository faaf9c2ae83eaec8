"""Gemma 3 images (an image's tokens attending to each other both ways) through
/v1/chat/completions with a data URI answer what transformers answers."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from pagedserve.testing.tiny_vlm import (  # noqa: E402
    GEMMA3_IMAGE,
    build_gemma3,
    hf_greedy_gemma3,
    png_data_uri,
    random_image,
)


def test_gemma3_image_url(server_factory, tiny_server_args, tmp_path_factory):
    from pagedserve.models.gemma3_vision import load_gemma3_processor

    folder = tmp_path_factory.mktemp("gemma3-server")
    model = build_gemma3(folder)
    server = server_factory(str(folder), list(tiny_server_args))
    img = random_image(43, (40, 52))
    prompt = f"<|im_start|>user\nWhat is this?\n{GEMMA3_IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    _, tokens, logprobs = hf_greedy_gemma3(model, folder, prompt, [img], 5)
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png_data_uri(img)}}]
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == load_gemma3_processor(str(folder)).tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got == pytest.approx(logprobs, abs=2e-4)
