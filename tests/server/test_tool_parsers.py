"""Tool-call parsers, reasoning parsers, tool_choice planning and the shaping of chat
answers (whole and streamed) without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.chat_output import ChatOutput
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedserve.entrypoints.openai.tool_parsers import get_tool_parser
from pagedserve.entrypoints.openai.tools import ToolOptions, plan_tools

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "Let me check.",
            [("f", {"a": 1})],
        ),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", '
            '"arguments": {}}</tool_call>',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        ("hermes", "no calls here", "no calls here", []),
        ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}',
            None,
            [("f", {"a": 2}), ("g", {})],
        ),
        ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 3}}]', None, [("f", {"a": 3})]),
        ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 4}"}]', "Sure", [("f", {"a": 4})]),
        ("pythonic", '[f(a=5), g(b="x", c=[1, 2])]', None, [("f", {"a": 5}), ("g", {"b": "x", "c": [1, 2]})]),
        ("pythonic", "[not a call]", "[not a call]", []),
    ],
)
def test_tool_parsers(parser, text, content, calls):
    got_content, got = get_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        ToolOptions(enable_auto_tool_choice=True, tool_call_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)


def test_reasoning_parsers():
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.split("<think>plan</think>\n\nanswer") == ("plan", "answer")
    assert r1.split("plan</think>answer") == ("plan", "answer")
    assert r1.split("still thinking", finished=False) == ("still thinking", "")
    q3 = get_reasoning_parser("qwen3")
    assert q3.split("<think>plan</think>answer") == ("plan", "answer")
    assert q3.split("just an answer") == (None, "just an answer")
    assert q3.split("<thi", finished=False) == ("", "")
    with pytest.raises(ValueError):
        get_reasoning_parser("o1")


def _req(**kw):
    return SimpleNamespace(**{"tools": [TOOL], "tool_choice": None, "parallel_tool_calls": None, **kw})


def test_tool_choice_plans():
    assert plan_tools(_req(tools=None), ToolOptions()).mode == "none"
    with pytest.raises(ApiError) as e:
        plan_tools(_req(), ToolOptions())
    assert e.value.status == 400 and "--enable-auto-tool-choice" in str(e.value.body())
    auto = plan_tools(_req(), ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    assert auto.mode == "auto" and auto.constraint is None
    req = plan_tools(_req(tool_choice="required", parallel_tool_calls=False), ToolOptions())
    assert req.constraint.json["maxItems"] == 1 and req.constraint.json["minItems"] == 1
    named = plan_tools(_req(tool_choice={"type": "function", "function": {"name": "f"}}), ToolOptions())
    assert named.constraint.json == TOOL["function"]["parameters"]
    with pytest.raises(ApiError):
        plan_tools(_req(tool_choice="sometimes"), ToolOptions())


def _stream(shaper: ChatOutput, pieces: list[str], reason: str = "stop") -> tuple[list[dict], str]:
    state, text, deltas = shaper.stream(), "", []
    for k, p in enumerate(pieces):
        text += p
        last = k == len(pieces) - 1
        d = state.delta(text, last, reason if last else None)
        if d:
            deltas.append(d)
    return deltas, shaper.finish_reason(reason, state.called)


def test_streamed_auto_holds_back_markers_and_sends_calls():
    plan = plan_tools(_req(), ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    shaper = ChatOutput(plan, None)
    pieces = ["Sure", ". <tool", '_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    deltas, finish = _stream(shaper, pieces)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == "Sure." and "<tool" not in content
    assert finish == "tool_calls" and calls[0]["function"]["name"] == "f" and calls[0]["index"] == 0
    msg, finish = shaper.message("".join(pieces), "stop")
    assert msg["content"] == "Sure." and msg["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


def test_streamed_reasoning_then_content():
    plan = plan_tools(_req(tools=None), ToolOptions())
    shaper = ChatOutput(plan, get_reasoning_parser("deepseek_r1"))
    deltas, finish = _stream(shaper, ["<think>", "a plan", "</think>", "the answer"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "a plan"
    assert "".join(d.get("content", "") for d in deltas) == "the answer"
    msg, _ = shaper.message("<think>a plan</think>the answer", "stop")
    assert msg == {"role": "assistant", "content": "the answer", "reasoning_content": "a plan"}


TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}\n{% endfor %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} CALL {{ c.function.name }} "
    "{{ c.function.arguments.a }}{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %} RESULT-FOR {{ m.tool_call_id }}{% endif %} {{ m.content or '' }}\n"
    "{% endfor %}{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}"
)


def test_tool_history_and_tools_reach_the_template():
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_messages
    from pagedserve.loader.chat_template import render_chat_template

    body = {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": [TOOL],
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    request = ChatCompletionRequest.model_validate(body)
    messages = chat_messages(request.messages)
    from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin

    # As serving_fields.chat_prompt_text merges them: the request's kwargs, then the tools.
    kwargs = {**request.chat_template_kwargs, **ChatToolsMixin().template_kwargs(request)}
    text = render_chat_template(TEMPLATE, messages, **kwargs)
    assert 'TOOL f {"type": "object"' in text
    assert "[assistant] CALL f 7" in text  # arguments handed over as an object
    assert "[tool] RESULT-FOR c1 42" in text
    assert text.endswith("thinking=False")


def test_bad_tool_history_is_400():
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_messages

    bad = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
                }
            ]
        }
    )
    with pytest.raises(ApiError) as e:
        chat_messages(bad.messages)
    assert e.value.status == 400 and "arguments" in e.value.body()["error"]["param"]
    with pytest.raises(ApiError):
        _template_kwargs({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})


def _template_kwargs(body: dict) -> dict:
    from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatToolsMixin().template_kwargs(ChatCompletionRequest.model_validate(body))
