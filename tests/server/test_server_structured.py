"""Structured outputs and tool calls through the official openai client, against
`pagedserve serve` on the default model (SmolLM2-135M)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagedserve.loader.model_path import default_model_path

MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture(scope="module")
def server(server_factory):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    return server_factory(
        None,
        [
            "--kv-cache-memory",
            "128MiB",
            "--max-model-len",
            "1024",
            "--threads",
            "1",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--structured-outputs-config",
            '{"backend": "xgrammar"}',
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", ASK), **{"max_tokens": 60, "temperature": 0, **kw}
    )


def test_response_format_json_schema(client):
    r = _chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), PERSON)


def test_response_format_json_object_streamed(client):
    stream = _chat(client, response_format={"type": "json_object"}, stream=True, max_tokens=80)
    text, finish = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_field_and_guided_aliases(client):
    r = _chat(client, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}, [0-9]{2} C"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{2} C", r.choices[0].message.content)
    r = _chat(client, extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = _chat(client, extra_body={"guided_grammar": 'root ::= "temp=" [0-9] [0-9]? "C"'})
    assert re.fullmatch(r"temp=[0-9]{1,2}C", r.choices[0].message.content)
    r = _chat(client, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(
        model=MODEL, prompt="Is water wet?", max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "kw, param",
    [
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
            "response_format.json_schema",
        ),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
        (dict(extra_body={"structured_outputs": {"regex": "([a-z"}}), "structured_outputs"),
        (dict(extra_body={"guided_grammar": "root ::= missing"}), "guided_grammar"),
        (dict(extra_body={"structured_outputs": {"json": PERSON, "backend": "outlines"}}), "structured_outputs"),
        (dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), None),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
                tool_choice="required",
            ),
            "tools[0].function.parameters",
        ),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
    ],
)
def test_bad_constraints_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **kw)
    assert e.value.status_code == 400
    if param is not None:
        assert e.value.body["param"] == param


def test_tool_choice_required(client):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_streamed_and_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    args, names, ids = "", [], set()
    for chunk in _chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function.name:
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
    assert names == ["get_weather"] and len(ids) == 1
    assert json.loads(args) == json.loads(call.function.arguments)


def test_required_streamed(client):
    calls = []
    finish = None
    for chunk in _chat(client, tools=[WEATHER], tool_choice="required", stream=True, max_tokens=80):
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_auto_and_tool_history(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = _chat(client, messages=history, tools=[WEATHER], tool_choice="auto", max_tokens=20)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    r = _chat(
        client,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
