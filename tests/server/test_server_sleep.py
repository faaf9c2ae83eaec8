"""The server's sleep routes (--enable-sleep-mode): POST /sleep?level=N, POST /wake_up,
GET /is_sleeping; requests while asleep get 503 ``engine_sleeping``; answers after waking
are the ones before; without the flag the routes do not exist."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine
from pagedserve.entrypoints.openai import ServerSettings, build_app

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0, "logprobs": 2}


def engine(path, sleep: bool) -> LLMEngine:
    model = ModelConfig(model=str(path), dtype="float32", enable_sleep_mode=sleep)
    return LLMEngine(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory="16MiB")))


@pytest.fixture(scope="module")
def client(tiny_llama):
    app = build_app(AsyncLLMEngine(engine(tiny_llama, True)), ServerSettings(["tiny"], enable_sleep_mode=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def completion(client) -> tuple[str, list]:
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("level", ["1", "2"])
def test_sleep_refuse_wake_same_answer(client, level):
    text, logprobs = completion(client)
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post(f"/sleep?level={level}").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_sleeping" and "wake" in err["message"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
    r = client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
    # What needs no weights still answers (as in vLLM): tokenization, the model list.
    assert client.post("/tokenize", json={"model": "tiny", "prompt": "hi"}).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.post("/wake_up").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    again, again_logprobs = completion(client)
    assert again == text
    assert again_logprobs == pytest.approx(logprobs, abs=1e-5)


@pytest.mark.parametrize("query", ["level=3", "level=x", "level=1&foo=2"])
def test_sleep_bad_query(client, query):
    r = client.post(f"/sleep?{query}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_wake_up_tags_not_implemented(client):
    r = client.post("/wake_up?tags=weights")
    assert r.status_code == 400 and "tags" in r.json()["error"]["message"]


def test_routes_absent_without_flag(tiny_llama):
    app = build_app(AsyncLLMEngine(engine(tiny_llama, False)), ServerSettings(["tiny"]))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/sleep").status_code == 404
        assert c.post("/wake_up").status_code == 404
        assert c.get("/is_sleeping").status_code == 404
