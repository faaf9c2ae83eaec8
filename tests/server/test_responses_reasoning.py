"""/v1/responses on a server with a reasoning parser, an API key and a store file: reasoning
items (whole and streamed) equal chat's reasoning_content, /v1/responses needs the key,
and a stored response survives a restart of the server."""

from __future__ import annotations

import json

import httpx
import pytest

BASE = {"model": "tiny", "input": "Hello world", "max_output_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 4, "temperature": 0}


def text_of(resp: dict) -> str:
    return "".join(p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"])


def sse_events(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]


def _with_think_token(tiny_llama, folder):
    """The tiny checkpoint with its unused special token 0 renamed ``</think>``, the one
    token deepseek_r1 needs."""
    import shutil

    shutil.copytree(tiny_llama, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {("</think>" if i == 0 else t): i for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        if added["id"] == 0:
            added["content"] = "</think>"
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


@pytest.fixture(scope="module")
def reasoning_server(server_factory, tiny_llama, tiny_server_args, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning")
    model = _with_think_token(tiny_llama, folder / "model")
    args = [
        *tiny_server_args,
        "--served-model-name",
        "tiny",
        "--reasoning-parser",
        "deepseek_r1",
        "--responses-store-path",
        str(folder / "store.sqlite"),
        "--api-key",
        "sekret",
    ]
    return server_factory(str(model), args, api_key="sekret")


AUTH = {"Authorization": "Bearer sekret"}


def test_reasoning_items_and_api_key(reasoning_server):
    server = reasoning_server
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        assert httpx.post(server.url + "/v1/responses", json=BASE).status_code == 401
        assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
        resp = c.post("/v1/responses", json=BASE).json()
        ref = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        # deepseek_r1: text before </think> is reasoning, and all of it while </think> is not out.
        reasoning = [o for o in resp["output"] if o["type"] == "reasoning"]
        assert ref["reasoning_content"] and reasoning
        assert reasoning[0]["content"] == [{"type": "reasoning_text", "text": ref["reasoning_content"]}]
        assert text_of(resp) == (ref["content"] or "")
        assert 0 < resp["usage"]["output_tokens_details"]["reasoning_tokens"] <= resp["usage"]["output_tokens"]
        events = sse_events(c.post("/v1/responses", json={**BASE, "stream": True}))
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert streamed == ref["reasoning_content"]
        assert [e["type"] for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
        assert events[2]["item"]["type"] == "reasoning" and events[3]["part"]["type"] == "reasoning_text"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == streamed


@pytest.mark.slow
def test_store_file_survives_a_restart(reasoning_server):
    server = reasoning_server
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        resp = c.post("/v1/responses", json=BASE).json()
    server.stop()
    server.start()  # the same flags: the store file is read again
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        assert c.get(f"/v1/responses/{resp['id']}").json() == resp
