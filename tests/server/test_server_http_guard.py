"""The app in-process on the tiny model: JSON-only bodies (415), the CORS policy, the
OpenAPI document, /v1/models/ without an id, quiet logs for clients that hang up
mid-upload, and streams cut at the end of the shutdown grace period."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from starlette.testclient import TestClient

from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine
from pagedserve.entrypoints.openai import ServerSettings, build_app
from pagedserve.entrypoints.openai.http_guard import CorsSettings, add_http_security_arguments, cors_settings_from_args
from pagedserve.entrypoints.openai.shutdown import SHUTDOWN_MESSAGE, Drain

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def llm_engine(tiny_llama):
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_llama), dtype="float32"), cache=CacheConfig(kv_cache_memory="16MiB")
        )
    )


def client_for(llm_engine, **settings) -> TestClient:
    app = build_app(AsyncLLMEngine(llm_engine), ServerSettings(["tiny"], **settings))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(llm_engine):
    with client_for(llm_engine) as c:
        yield c


def assert_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_json_bodies_are_refused_with_415(client, path, content_type):
    body = json.dumps({**COMPLETION, "messages": [{"role": "user", "content": "x"}]}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    err = assert_error(client.post(path, content=body, headers=headers), 415, "unsupported_media_type")
    assert "application/json" in err["message"]


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"],
)
def test_json_content_types_are_accepted(client, content_type):
    r = client.post("/v1/completions", content=json.dumps(COMPLETION), headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_no_cors_headers_by_default(client):
    r = client.post("/v1/completions", json=COMPLETION, headers={"origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = client.options(
        "/v1/completions",
        headers={
            "origin": "https://evil.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert "access-control-allow-origin" not in pre.headers


def test_allowed_origins_get_cors_headers_even_with_an_api_key(llm_engine):
    cors = CorsSettings(["https://app.example"], ["POST"], ["content-type", "authorization"])
    with client_for(llm_engine, cors=cors, api_key="k") as c:
        pre = c.options(
            "/v1/completions",
            headers={
                "origin": "https://app.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = c.post(
            "/v1/completions", json=COMPLETION, headers={"origin": "https://app.example", "authorization": "Bearer k"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options(
            "/v1/completions", headers={"origin": "https://evil.example", "access-control-request-method": "POST"}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_cors_flags_parse_json_and_comma_lists():
    import argparse

    p = argparse.ArgumentParser()
    add_http_security_arguments(p)
    a = p.parse_args(["--allowed-origins", '["http://a:1", "http://b"]', "--allowed-methods", "GET, POST"])
    assert cors_settings_from_args(a) == CorsSettings(["http://a:1", "http://b"], ["GET", "POST"], ["*"], False)
    assert p.parse_args([]).allowed_origins == []
    with pytest.raises(SystemExit):
        p.parse_args(["--allowed-origins", "[1, 2]"])
    with pytest.raises(ValueError, match="wildcard"):
        cors_settings_from_args(p.parse_args(["--allowed-origins", "*", "--allow-credentials"]))


def test_openapi_document_describes_the_request_models(client):
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert {"400", "415", "503"} <= set(op["responses"])
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"][0] == "system"
    assert {"/v1/models", "/v1/models/{model}", "/health"} <= set(doc["paths"])
    docs = client.get("/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "length_penalty": 2.0},
        {"messages": [{"role": "user", "content": "hi"}], "length_penalty": 1.0},
        {"messages": [{"role": "user", "content": "hi"}], "length_penalty": 0.5, "use_beam_search": True, "n": 2},
    ],
    ids=lambda b: json.dumps(b)[:60],
)
def test_openapi_chat_rules_agree_with_the_server(client, body):
    """The document's rules between fields are the server's: a body the schema accepts is
    served, one it rejects is refused with a 400 (what a schema-based client relies on)."""
    import jsonschema

    doc = client.get("/openapi.json").json()
    schema = {"$ref": "#/components/schemas/ChatCompletionRequest", "components": doc["components"]}
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == (200 if valid else 400), (valid, r.status_code, r.text)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "echo": True},
        {"prompt": "hi", "best_of": 2},
        {"prompt": "hi", "best_of": 200},
        {"prompt": "hi", "logit_bias": {"5": 1.5}},
        {"prompt": "hi", "temperature": 2},
        {"prompt": "hi", "temperature": 2.5},
    ],
    ids=lambda b: json.dumps(b)[:60],
)
def test_openapi_completion_fields_agree_with_the_server(client, body):
    """Fields the server honours are not documented as refused, and the documented ranges
    are the server's: schema-valid bodies are served, schema-invalid ones refused."""
    import jsonschema

    doc = client.get("/openapi.json").json()
    schema = {"$ref": "#/components/schemas/CompletionRequest", "components": doc["components"]}
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    r = client.post("/v1/completions", json={**body, "max_tokens": 2})
    assert r.status_code == (200 if valid else 400), (valid, r.status_code, r.text)


def test_models_with_an_empty_id_is_404(client):
    assert_error(client.get("/v1/models/"), 404, "model_not_found")
    assert_error(client.get("/v1/models/nope"), 404, "model_not_found")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_a_client_leaving_mid_upload_logs_one_info_line(llm_engine, caplog):
    app = build_app(AsyncLLMEngine(llm_engine), ServerSettings(["tiny"]))
    messages = [{"type": "http.request", "body": b'{"prompt": "he', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8000),
        "app": app,
    }
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    lines = [r for r in caplog.records if "disconnected while sending" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None


def test_drain_cut_ends_a_stream_with_an_error_event_and_done():
    async def events():
        yield "data: first\n\n"
        await asyncio.sleep(3600)  # a stream that would outlive the grace period
        yield "data: never\n\n"

    async def main():
        drain = Drain()
        out = []
        guard = drain.guard(events(), "r1")
        out.append(await guard.__anext__())
        asyncio.get_running_loop().call_later(0.05, drain.cut)
        async for line in guard:
            out.append(line)
        return out

    out = asyncio.run(asyncio.wait_for(main(), 10))
    assert out[0] == "data: first\n\n" and out[-1] == "data: [DONE]\n\n" and len(out) == 3
    err = json.loads(out[1][len("data: ") :])["error"]
    assert err["code"] == "server_shutdown" and err["message"] == SHUTDOWN_MESSAGE


def test_closing_a_guarded_stream_cancels_its_pending_read():
    cleaned = []

    async def events():
        try:
            yield "data: first\n\n"
            await asyncio.sleep(3600)
            yield "data: never\n\n"
        finally:
            cleaned.append(True)

    async def main():
        async with asyncio.timeout(10):
            return await scenario()

    async def scenario():
        guard = Drain().guard(events())
        assert await guard.__anext__() == "data: first\n\n"
        reader = asyncio.ensure_future(guard.__anext__())  # waits inside the inner generator
        await asyncio.sleep(0.05)
        reader.cancel()  # what the server does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await reader
        await guard.aclose()
        await asyncio.sleep(0.01)  # cancelled tasks finish on the next loop turns
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    pending = asyncio.run(main())
    assert cleaned == [True] and not pending
