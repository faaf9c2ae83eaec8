"""The real default model (SmolLM2-135M-Instruct, GGUF) served with no MODEL argument:
a few greedy answers must equal the offline API's on the same model."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.loader.model_path import default_model_path

ENGINE = {"kv_cache_memory": "256MiB", "max_model_len": 2048}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(server_factory):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    return server_factory(
        None,
        [
            "--kv-cache-memory",
            ENGINE["kv_cache_memory"],
            "--max-model-len",
            str(ENGINE["max_model_len"]),
            "--threads",
            "1",
        ],
    )


@pytest.fixture(scope="module")
def offline_default():
    from pagedserve import LLM

    return LLM(**ENGINE)


def test_default_model_is_served_under_its_alias(default_server):
    models = default_server.openai().models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_greedy_chat_equals_offline(default_server, offline_default):
    resp = default_server.openai().chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=7, temperature=0
    )
    ref = offline_default.chat(QUESTION, SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    text = resp.choices[0].message.content
    assert text == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason


def test_greedy_streamed_completion_equals_offline(default_server, offline_default):
    prompt = "The capital of France is"
    stream = default_server.openai().completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=4, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    ref = offline_default.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert text == ref.outputs[0].text
    assert "Paris" in text  # the model itself, not only agreement between two paths
