"""/v1/responses without a server: input items to chat messages, and the event sequence
of a streamed answer with reasoning, text and parsed tool calls (the hermes parser under
tool_choice auto, which the live tests' model does not speak)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.chat_output import ChatOutput
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedserve.entrypoints.openai.responses_output import ResponseEvents, output_items
from pagedserve.entrypoints.openai.responses_protocol import chat_messages_of
from pagedserve.entrypoints.openai.tools import ToolOptions, plan_tools

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hidden"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    assert chat_messages_of(items, "be kind") == [
        {"role": "system", "content": "be kind"},
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    with pytest.raises(ApiError) as e:
        chat_messages_of([{"type": "reasoning"}], "only instructions")
    assert e.value.param == "input"


def _events(shaper: ChatOutput, pieces: list[str]) -> tuple[list[dict], ResponseEvents]:
    ev, state, text, sse = ResponseEvents(), shaper.stream(), "", []
    for k, p in enumerate(pieces):
        text += p
        last = k == len(pieces) - 1
        sse += ev.delta(state.delta(text, last, "stop" if last else None))
    sse += ev.close()
    return [json.loads(s.split("data: ", 1)[1]) for s in sse], ev


def test_stream_of_reasoning_text_and_an_auto_call():
    request = SimpleNamespace(tools=[TOOL], tool_choice=None, parallel_tool_calls=None)
    plan = plan_tools(request, ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    shaper = ChatOutput(plan, get_reasoning_parser("deepseek_r1"))
    pieces = [
        "<think>",
        "plan",
        " it</think>",
        "Sure",
        ". <tool",
        '_call>{"name": "f", ',
        '"arguments": {"a": 1}}</tool_call>',
    ]
    events, ev = _events(shaper, pieces)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    n_reason = types.count("response.reasoning_text.delta")
    n_text = types.count("response.output_text.delta")
    assert types == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * n_reason,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n_text,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    reasoning, message, call = ev.output
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert message["content"][0]["text"].strip() == "Sure." and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("f", {"a": 1})
    # The whole answer gives the same items (ids aside; the stream sent the text's trailing
    # space before it could know a call follows, as chat streams do).
    whole = output_items(shaper.message("".join(pieces), "stop")[0], "completed", None)

    def strip(items):
        out = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]
        for i in out:
            if i["type"] == "message":
                i["content"] = [{**p, "text": p["text"].strip()} for p in i["content"]]
        return out

    assert strip(whole) == strip(ev.output)
