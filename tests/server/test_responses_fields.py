"""/v1/responses field by field on the tiny checkpoint: every field of the official
`openai` package's ``ResponseCreateParams`` is honoured (a behaviour check, mostly against
/v1/chat/completions on the same server) or refused with a 400 naming it.  Also the
errors' fields and the response store's bounds and SQLite file (reasoning items, --api-key
and a restart: test_responses_reasoning.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from pagedserve.entrypoints.openai.responses_protocol import RESPONSES_FIELDS
from pagedserve.entrypoints.openai.responses_store import ResponseStore, ResponseStoreConfig, StoredResponse

# The server's template renders the reasoning effort, so a test can see it arrive.
TEMPLATE = (
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
BASE = {"model": "tiny", "input": "Hello world", "max_output_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 4, "temperature": 0}
FN = {
    "type": "function",
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama, tiny_server_args, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return server_factory(
        str(tiny_llama), [*tiny_server_args, "--served-model-name", "tiny", "--chat-template", str(template)]
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def create(http, **fields) -> dict:
    r = http.post("/v1/responses", json={**BASE, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **fields) -> dict:
    r = http.post("/v1/chat/completions", json={**CHAT, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(resp: dict) -> str:
    return "".join(p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"])


def same_as_chat(resp: dict, ref: dict) -> None:
    assert text_of(resp) == ref["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == ref["usage"]["completion_tokens"]
    assert resp["status"] == ("incomplete" if ref["choices"][0]["finish_reason"] == "length" else "completed")


def refused(http, field: str, value, param: str | None = None) -> None:
    r = http.post("/v1/responses", json={**BASE, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == (param or field) and f"'{param or field}'" in r.json()["error"]["message"]


def sse_events(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]


# -- one check per honoured field ------------------------------------------------------------------
def _model(http):
    assert create(http, model="tiny")["model"] == "tiny"
    r = http.post("/v1/responses", json={**BASE, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _input(http):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello world"}]}]
    same_as_chat(create(http, input=items), chat(http))
    same_as_chat(create(http), chat(http))


def _instructions(http):
    resp = create(http, instructions="Be brief.")
    same_as_chat(resp, chat(http, messages=[{"role": "system", "content": "Be brief."}, *CHAT["messages"]]))
    assert resp["instructions"] == "Be brief."


def _max_output_tokens(http):
    resp = create(http, max_output_tokens=2)
    same_as_chat(resp, chat(http, max_tokens=2))
    if resp["status"] == "incomplete":
        assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    r = http.post("/v1/responses", json={**BASE, "max_output_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
    assert "'max_output_tokens'" in r.json()["error"]["message"]


def _temperature(http):
    resp = create(http, temperature=0.0)
    same_as_chat(resp, chat(http, temperature=0.0))
    assert resp["temperature"] == 0.0


def _top_p(http):
    # A vanishing nucleus keeps only the most likely token: greedy even at temperature 1.
    resp = create(http, temperature=1.0, top_p=1e-9, max_output_tokens=6)
    same_as_chat(resp, chat(http, temperature=0.0, max_tokens=6))
    assert resp["top_p"] == 1e-9


def _tools(http):
    # One call at most: the random model would fill the context with calls otherwise.
    out = create(http, tools=[FN], tool_choice="required", parallel_tool_calls=False, max_output_tokens=None)["output"]
    calls = [o for o in out if o["type"] == "function_call"]
    assert calls and {c["name"] for c in calls} == {"f"}
    refused(http, "tools", [{"type": "web_search"}], "tools[0].type")


def _tool_choice(http):
    (call,) = create(http, tools=[FN], tool_choice={"type": "function", "name": "f"}, max_output_tokens=None)["output"]
    assert call["type"] == "function_call" and call["name"] == "f"
    assert json.loads(call["arguments"]) in ({"a": True}, {"a": False})
    resp = create(http, tools=[FN], tool_choice="none")
    same_as_chat(resp, chat(http, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"))
    refused(http, "tool_choice", {"type": "function", "name": "missing"}, "tool_choice")


def _parallel_tool_calls(http):
    out = create(http, tools=[FN], tool_choice="required", parallel_tool_calls=False, max_output_tokens=None)["output"]
    assert [o["type"] for o in out] == ["function_call"]
    assert create(http, parallel_tool_calls=False)["parallel_tool_calls"] is False


def _text(http):
    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema}
    resp = create(http, text={"format": fmt}, max_output_tokens=10)
    assert json.loads(text_of(resp)) in ("yes", "no")
    assert resp["text"]["format"] == fmt
    refused(http, "text", {"format": {"type": "json_schema", "schema": {"type": 5}}}, "text.format.schema")
    refused(http, "text", {"verbosity": "high"}, "text.verbosity")


def _reasoning(http):
    resp = create(http, reasoning={"effort": "low", "summary": "auto"})
    same_as_chat(resp, chat(http, chat_template_kwargs={"reasoning_effort": "low"}))
    assert resp["usage"]["input_tokens"] > create(http)["usage"]["input_tokens"]  # the template saw it
    assert resp["reasoning"] == {"effort": "low", "summary": "auto"}
    refused(http, "reasoning", {"summary": "detailed"}, "reasoning.summary")


def _include(http):
    resp = create(http, include=["message.output_text.logprobs"])
    ref = chat(http, logprobs=True)
    got = resp["output"][0]["content"][0]["logprobs"]
    assert [(e["token"], round(e["logprob"], 4)) for e in got] == [
        (e["token"], round(e["logprob"], 4)) for e in ref["choices"][0]["logprobs"]["content"]
    ]
    assert len(got) == resp["usage"]["output_tokens"]
    refused(http, "include", ["reasoning.encrypted_content"])


def _top_logprobs(http):
    resp = create(http, include=["message.output_text.logprobs"], top_logprobs=2)
    ref = chat(http, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    got = resp["output"][0]["content"][0]["logprobs"]
    assert [[t["token"] for t in e["top_logprobs"]] for e in got] == [
        [t["token"] for t in e["top_logprobs"]] for e in ref
    ]
    assert all(len(e["top_logprobs"]) == 2 for e in got)
    refused(http, "top_logprobs", 2)  # without include


def _store(http):
    kept = create(http, store=True)
    assert http.get(f"/v1/responses/{kept['id']}").json() == kept
    gone = create(http, store=False)
    assert gone["store"] is False and http.get(f"/v1/responses/{gone['id']}").status_code == 404


def _stream(http):
    r = http.post("/v1/responses", json={**BASE, "stream": True})
    events = sse_events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text_of(events[-1]["response"]) == text_of(create(http))


def _stream_options(http):
    r = http.post("/v1/responses", json={**BASE, "stream": True, "stream_options": {"include_obfuscation": True}})
    deltas = [e for e in sse_events(r) if e["type"].endswith(".delta")]
    assert deltas and all(e["obfuscation"] for e in deltas)
    r = http.post("/v1/responses", json={**BASE, "stream": True})
    assert not any("obfuscation" in e for e in sse_events(r))
    refused(http, "stream_options", {"include_obfuscation": True})  # without stream


def _previous_response_id(http):
    first = create(http)
    second = create(http, input="Again", previous_response_id=first["id"])
    history = [
        *CHAT["messages"],
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "Again"},
    ]
    same_as_chat(second, chat(http, messages=history))
    r = http.post("/v1/responses", json={**BASE, "previous_response_id": "resp_missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def _echoed(field: str, value) -> Callable:
    def check(http):
        resp = create(http, **{field: value})
        assert resp[field] == value
        assert http.get(f"/v1/responses/{resp['id']}").json()[field] == value
        same_as_chat(resp, chat(http))

    return check


def _service_tier(http):
    assert create(http, service_tier="auto")["service_tier"] == "default"
    refused(http, "service_tier", "flex")


def _truncation(http):
    assert create(http, truncation="disabled")["truncation"] == "disabled"
    refused(http, "truncation", "auto")


def _poll(http, response_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = http.get(f"/v1/responses/{response_id}").json()
        if got["status"] not in ("queued", "in_progress"):
            return got
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still {got['status']}")


def _background(http):
    assert create(http, background=False)["background"] is False
    queued = create(http, background=True)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    done = _poll(http, queued["id"])
    assert done["background"] is True
    same_as_chat(done, chat(http))
    assert http.post(f"/v1/responses/{done['id']}/cancel").json() == done  # finished: answered as it is
    # A long one (the whole context) cancelled while it runs.
    long = create(http, background=True, max_output_tokens=None, temperature=1.0)
    cancelled = http.post(f"/v1/responses/{long['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    time.sleep(0.5)
    assert http.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"
    r = http.post("/v1/responses", json={**BASE, "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    r = http.post("/v1/responses", json={**BASE, "background": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


CASES: dict[str, Callable] = {
    "model": _model,
    "input": _input,
    "instructions": _instructions,
    "max_output_tokens": _max_output_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _parallel_tool_calls,
    "text": _text,
    "reasoning": _reasoning,
    "include": _include,
    "top_logprobs": _top_logprobs,
    "store": _store,
    "stream": _stream,
    "stream_options": _stream_options,
    "previous_response_id": _previous_response_id,
    "metadata": _echoed("metadata", {"topic": "test"}),
    "user": _echoed("user", "user-1"),
    "safety_identifier": _echoed("safety_identifier", "hashed-user"),
    "prompt_cache_key": _echoed("prompt_cache_key", "conversation-7"),
    "service_tier": _service_tier,
    "truncation": _truncation,
    "background": _background,
}

REFUSED_VALUES = {
    "access_programs": {"cyber": "standard"},
    "background_options": {"completion_window": "2h"},
    "context_management": [{"type": "compaction"}],
    "conversation": "conv_1",
    "image": {"context_compression": "enabled"},
    "max_tool_calls": 3,
    "moderation": {"model": "omni-moderation-latest"},
    "prompt": {"id": "pmpt_1"},
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
}

# `stream` lives on the streaming / non-streaming variants of the params type.
OFFICIAL = sorted({*ResponseCreateParamsBase.__annotations__, "stream"})


def test_every_official_field_is_listed():
    assert sorted(RESPONSES_FIELDS) == OFFICIAL


@pytest.mark.parametrize("field", OFFICIAL)
def test_field_is_honoured_or_refused(http, field):
    if RESPONSES_FIELDS[field].status == "honoured":
        CASES[field](http)
    else:
        refused(http, field, REFUSED_VALUES[field])


def test_every_field_has_a_check():
    for name, f in RESPONSES_FIELDS.items():
        assert name in (CASES if f.status == "honoured" else REFUSED_VALUES), name


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": None}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input[0].arguments"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]}, "tools[0].parameters"),
    ],
)
def test_bad_values_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/responses", json={**BASE, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_ids_are_404(http):
    for method, path in [
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("GET", "/v1/responses/resp_x/input_items"),
        ("POST", "/v1/responses/resp_x/cancel"),
    ]:
        r = http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)


def test_input_items_pages(http):
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    resp = create(http, input=items, max_output_tokens=1)
    page = http.get(f"/v1/responses/{resp['id']}/input_items", params={"limit": 2, "order": "asc"}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["m0", "m1"] and page["has_more"]
    after = http.get(
        f"/v1/responses/{resp['id']}/input_items", params={"limit": 5, "order": "asc", "after": page["last_id"]}
    ).json()
    assert [i["content"][0]["text"] for i in after["data"]] == ["m2", "m3", "m4"] and not after["has_more"]
    desc = http.get(f"/v1/responses/{resp['id']}/input_items").json()
    assert [i["content"][0]["text"] for i in desc["data"]] == ["m4", "m3", "m2", "m1", "m0"]


# -- the store -------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stored(i: int) -> StoredResponse:
    return StoredResponse({"id": f"r{i}", "output": [{"n": i}]}, [{"id": f"i{i}"}])


def test_store_drops_the_oldest_past_max_entries_and_old_ones_past_max_age():
    clock = Clock()
    store = ResponseStore(ResponseStoreConfig(max_entries=3, max_age_s=60), clock)
    for i in range(5):
        clock.now += 1
        store.put(f"r{i}", _stored(i))
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("r4") == _stored(4) and len(store) == 3
    clock.now += 59
    assert store.get("r2") is None and store.get("r4") is not None  # r2 is 61 s old
    clock.now += 10
    assert len(store) == 0
    assert store.delete("r4") is True and store.delete("r4") is False
    none = ResponseStore(ResponseStoreConfig(max_entries=0))
    none.put("r", _stored(0))
    assert none.get("r") is None
    with pytest.raises(ValueError, match="max-age"):
        ResponseStoreConfig(max_age_s=0)
    with pytest.raises(ValueError, match="folder does not exist"):
        ResponseStoreConfig(path="/no/such/folder/responses.sqlite")


def test_store_file_outlives_the_store(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    store = ResponseStore(ResponseStoreConfig(path=path))
    store.put("r1", _stored(1))
    store.close()
    assert ResponseStore(ResponseStoreConfig(path=path)).get("r1") == _stored(1)
