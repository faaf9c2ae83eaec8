"""Gemma 3 images (an image's tokens attending to each other both ways) and SmolVLM images
(tiles) through /v1/chat/completions with a data URI answer what transformers answers."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from pagedserve.testing.tiny_vlm import (  # noqa: E402
    GEMMA3_IMAGE,
    build_gemma3,
    build_smolvlm,
    hf_greedy_gemma3,
    hf_greedy_smolvlm,
    png_data_uri,
    random_image,
)


@pytest.mark.parametrize("family", ["gemma3", pytest.param("smolvlm", marks=pytest.mark.slow)])
def test_image_url(family, server_factory, tiny_server_args, tmp_path_factory):
    from pagedserve.models.gemma3_vision import load_gemma3_processor
    from pagedserve.models.smolvlm_vision import load_smolvlm_processor

    folder = tmp_path_factory.mktemp(f"{family}-server")
    build, greedy, load, placeholder = {
        "gemma3": (build_gemma3, hf_greedy_gemma3, load_gemma3_processor, GEMMA3_IMAGE),
        "smolvlm": (build_smolvlm, hf_greedy_smolvlm, load_smolvlm_processor, "<image>"),
    }[family]
    model = build(folder)
    server = server_factory(str(folder), list(tiny_server_args))
    img = random_image(43, (40, 52))
    prompt = f"<|im_start|>user\nWhat is this?\n{placeholder}<|im_end|>\n<|im_start|>assistant\n"
    _, tokens, logprobs = greedy(model, folder, prompt, [img], 5)
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
    assert choice["message"]["content"] == load(str(folder)).tokenizer.decode(tokens, skip_special_tokens=True)
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got == pytest.approx(logprobs, abs=2e-4)
