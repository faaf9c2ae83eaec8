"""POST /v1/messages and /v1/messages/count_tokens with the official `anthropic` client
against `pagedserve serve` on the default model: greedy answers equal the same
conversation through chat completions, Anthropic's stop reasons, events and errors."""

from __future__ import annotations

import json
import typing

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from pagedserve.loader.model_path import default_model_path  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "sk-messages-test"
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the anthropic client no longer types temperature; the API has it
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def server(server_factory):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    return server_factory(
        None,
        ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--threads", "1", "--api-key", KEY],
        # The tests compare a Messages reply with the chat completion of the same prompt,
        # which reads the first one's blocks from the prefix cache: only the static,
        # chunk-invariant kernels give both the same greedy tokens (measured dispatch picks
        # attention per query count; docs/kernels_cpu.md, "Chunking invariance").
        env={"PAGEDSERVE_CPU_TUNE": "0", "PAGEDSERVE_CPU_AMX_ATTENTION": "0"},
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _chat(server, messages, **kwargs):
    return server.openai().chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_equals_chat_completions(server, client):
    msg = client.messages.create(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
    )
    ref = _chat(server, [{"role": "user", "content": QUESTION}], max_tokens=24)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert _text(msg) == ref.choices[0].message.content
    assert msg.usage.input_tokens == ref.usage.prompt_tokens
    assert msg.usage.output_tokens == ref.usage.completion_tokens
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
    assert msg.stop_sequence is None


@pytest.mark.parametrize("system", ["You answer in one word.", [{"type": "text", "text": "You answer in one word."}]])
def test_system_prompt(server, client, system):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        system=system,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        extra_body=GREEDY,
    )
    ref = _chat(
        server,
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": QUESTION}],
        max_tokens=16,
    )
    assert _text(msg) == ref.choices[0].message.content
    assert msg.usage.input_tokens == ref.usage.prompt_tokens


def test_final_assistant_turn_is_continued(server, client):
    prefill = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital of France"}]
    msg = client.messages.create(model=MODEL, max_tokens=8, messages=prefill, extra_body=GREEDY)
    ref = server.openai().chat.completions.create(
        model=MODEL,
        messages=prefill,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert _text(msg) == ref.choices[0].message.content
    assert msg.usage.input_tokens == ref.usage.prompt_tokens


def test_stop_sequence_and_max_tokens(client):
    full = _text(
        client.messages.create(
            model=MODEL, max_tokens=24, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
        )
    )
    word = full.split()[2]  # a word inside the answer
    msg = client.messages.create(
        model=MODEL,
        max_tokens=24,
        stop_sequences=["nothing-like-this", word],
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert _text(msg) == full[: full.index(word)]
    short = client.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert full.startswith(_text(short))


def _sse_events(server, body: dict) -> list[tuple[str, dict]]:
    events = []
    with httpx.stream(
        "POST", server.url + "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_stream_events_and_text(server, client):
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    whole = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=body["messages"], extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens

    names = [n for n, _ in _sse_events(server, body)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_tool_use_with_any_and_tool_result_round_trip(server, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(
        model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"}, messages=ask, extra_body=GREEDY
    )
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    assert call.id.startswith("toolu_")

    # Streamed: the same call, its input sent as input_json_delta events.
    events = _sse_events(
        server,
        {
            "model": MODEL,
            "max_tokens": 60,
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
            "messages": ask,
            **GREEDY,
        },
    )
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == call.input
    assert [d["delta"]["stop_reason"] for n, d in events if n == "message_delta"] == ["tool_use"]

    # The result goes back as a tool_result block; the prompt equals chat completions' tool turn.
    follow = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=20, tools=[WEATHER], tool_choice={"type": "none"}, messages=follow, extra_body=GREEDY
    )
    chat_follow = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    ref = _chat(server, chat_follow, max_tokens=20, tools=[CHAT_WEATHER], tool_choice="none")
    assert answer.usage.input_tokens == ref.usage.prompt_tokens
    assert _text(answer) == ref.choices[0].message.content
    blocks = [{"type": "text", "text": "Sunny, 21 C"}]
    follow[-1]["content"][0]["content"] = blocks  # block content reads the same
    again = client.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"}, messages=follow)
    assert again.input_tokens == ref.usage.prompt_tokens


def test_named_tool_choice(client):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "tool_use"
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_weather"]


def test_count_tokens_equals_prompt_tokens(server, client):
    messages = [{"role": "user", "content": QUESTION}]
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    ref = _chat(server, [{"role": "system", "content": "Be brief."}, *messages], max_tokens=1)
    assert count.input_tokens == ref.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=messages)
    ref = _chat(server, messages, max_tokens=1, tools=[CHAT_WEATHER], tool_choice="none")
    assert with_tools.input_tokens == ref.usage.prompt_tokens > count.input_tokens - 10


def _error(server, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    r = httpx.post(server.url + "/v1/messages", json=body, headers=headers or {"x-api-key": KEY}, timeout=60)
    return r.status_code, r.json()


def test_errors_have_anthropic_shape(server, client):
    user = [{"role": "user", "content": "Hi"}]
    status, body = _error(server, {"model": MODEL, "messages": user})
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="multimodal"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=user)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=user
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    # Anthropic's x-api-key header (what _error sends) and the bearer token both carry the key.
    status, body = _error(server, {"model": MODEL, "max_tokens": 5, "messages": user}, {"x-api-key": "wrong"})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": user},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    status, body = _error(
        server, {"model": MODEL, "max_tokens": 5, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 2}}
    )
    assert status == 400 and "--reasoning-parser" in body["error"]["message"]
    status, body = _error(server, {"model": MODEL, "max_tokens": 5, "messages": user, "tools": [WEATHER]})
    assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"]


# A non-default value of every request field; `True` marks the ones this server honours.
FIELD_VALUES: dict[str, tuple[object, bool]] = {
    "max_tokens": (4, True),
    "messages": ([{"role": "user", "content": "Hi"}], True),
    "model": (MODEL, True),
    "cache_control": ({"type": "ephemeral"}, True),
    "container": ("container_abc", False),
    "diagnostics": ({"enabled": True}, False),
    "inference_geo": ("us", False),
    "metadata": ({"user_id": "u-1"}, True),
    "output_config": ({"format": {"type": "json_schema", "schema": {"type": "object"}}}, True),
    "service_tier": ("standard_only", True),
    "speed": ("fast", False),
    "stop_sequences": (["\n\n"], True),
    "stream": (True, True),
    "system": ("Be brief.", True),
    "thinking": ({"type": "enabled", "budget_tokens": 2}, False),  # no --reasoning-parser on this server
    "tool_choice": ({"type": "any"}, True),
    "tools": ([WEATHER], True),
    "user_profile_id": ("prof_1", False),
    "workspace_id": ("ws_1", False),
    # In Anthropic's API reference, no longer typed by the client:
    "temperature": (0.5, True),
    "top_p": (0.9, True),
    "top_k": (5, True),
}


def test_field_walk_covers_the_client_params():
    from anthropic.types.message_create_params import MessageCreateParamsBase, MessageCreateParamsStreaming

    fields = set(typing.get_type_hints(MessageCreateParamsBase)) | set(
        typing.get_type_hints(MessageCreateParamsStreaming)
    )
    assert fields <= set(FIELD_VALUES), f"decide on: {sorted(fields - set(FIELD_VALUES))}"


@pytest.mark.parametrize("name", sorted(FIELD_VALUES))
def test_field_walk(server, name):
    value, honoured = FIELD_VALUES[name]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], name: value}
    if name == "tool_choice":
        body["tools"] = [WEATHER]
    if name == "tools":
        body["tool_choice"] = {"type": "none"}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    if honoured:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and name in err["message"]


def test_output_config_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "end_turn"
    assert json.loads(_text(msg))["answer"] in ("Paris", "Rome")


def test_calls_of_an_array_cut_by_max_tokens_are_returned(server, client):
    """tool_choice required / any with max_tokens inside the calls' array: the complete
    calls come back as calls (chat: finish_reason length; messages: stop_reason max_tokens)."""
    ask = [{"role": "user", "content": "Weather in Paris? Weather in London? Weather in Rome? Weather in Berlin?"}]
    answer = _chat(server, ask, tools=[CHAT_WEATHER], tool_choice="required", max_tokens=80)
    full, n = answer.choices[0], answer.usage.completion_tokens
    assert full.finish_reason == "tool_calls"
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
    cut_with_calls = 0
    for max_tokens in range(n - 2, n):
        cut = _chat(server, ask, tools=[CHAT_WEATHER], tool_choice="required", max_tokens=max_tokens).choices[0]
        assert cut.finish_reason == "length"
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in cut.message.tool_calls or []]
        assert calls == whole[: len(calls)]
        if calls:
            cut_with_calls += 1
            assert cut.message.content is None
            msg = client.messages.create(
                model=MODEL,
                max_tokens=max_tokens,
                tools=[WEATHER],
                tool_choice={"type": "any"},
                messages=ask,
                extra_body=GREEDY,
            )
            assert msg.stop_reason == "max_tokens"
            assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == calls
    assert cut_with_calls
