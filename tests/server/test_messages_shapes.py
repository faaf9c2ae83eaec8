"""The Messages API without a server: Anthropic requests turned into chat requests, and
chat answers (whole and streamed, with thinking and tool calls) turned into Anthropic's
message and events."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.messages_protocol import MessagesRequest, to_chat_request
from pagedserve.entrypoints.openai.serving_base import OpenAIServing
from pagedserve.entrypoints.openai.serving_messages import AnthropicServingMessages, _BlockWriter
from pagedserve.entrypoints.openai.tools import ToolOptions

WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_conversation_with_tool_use_and_results():
    req = _request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": None}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "sun"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather", "input": {"city": "X"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "is_error": True}]},
        ],
    )
    chat = to_chat_request(req, None)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs[0] == {"role": "system", "content": "Be brief.\nUse tools."}
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] == "Checking."  # thinking left out
    assert [json.loads(c["function"]["arguments"]) for c in msgs[2]["tool_calls"]] == [
        {"city": "Oslo"},
        {"city": "Rome"},
    ]
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in msgs[3:6]] == [
        ("tool", "toolu_1", "rain"),
        ("tool", "toolu_2", "sun"),
        ("user", None, "And tomorrow?"),
    ]
    assert msgs[-1] == {"role": "tool", "tool_call_id": "toolu_3", "content": "Error: "}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0]["function"] == {"name": "get_weather", "parameters": WEATHER["input_schema"]}
    assert chat.chat_template_kwargs is None  # no reasoning parser: the template is not told


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choices(choice, expected):
    assert to_chat_request(_request(tools=[WEATHER], tool_choice=choice), None).tool_choice == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "input_examples": [{"city": "a"}]}]}, "tools[0].input_examples"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]}, None),
        ({"temperature": 1.5}, "temperature"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ],
)
def test_refused_fields_are_named(fields, param):
    with pytest.raises(ApiError) as e:
        to_chat_request(_request(**fields), None)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param and param.split("[")[0].split(".")[0] in e.value.message


def test_thinking_with_a_reasoning_parser():
    chat = to_chat_request(_request(thinking={"type": "enabled", "budget_tokens": 16}), "qwen3")
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert to_chat_request(_request(thinking={"type": "disabled"}), "qwen3").chat_template_kwargs == {
        "enable_thinking": False
    }
    with pytest.raises(ApiError, match="budget_tokens"):
        to_chat_request(_request(thinking={"type": "enabled", "budget_tokens": 32}), "qwen3")


class _Chat(ChatToolsMixin):
    finish_reason = staticmethod(OpenAIServing.finish_reason)

    def __init__(self, options: ToolOptions) -> None:
        self.tool_options = options


def _output(text: str, finish: str, stop_reason=None, n_tokens: int = 5):
    c = SimpleNamespace(text=text, finish_reason=finish, stop_reason=stop_reason, token_ids=list(range(n_tokens)))
    return SimpleNamespace(outputs=[c], prompt_token_ids=[1, 2, 3])


def test_whole_message_with_thinking_text_and_stop_reasons():
    serving = AnthropicServingMessages(_Chat(ToolOptions(reasoning_parser="qwen3")))
    creq = to_chat_request(_request(thinking={"type": "adaptive"}), "qwen3")
    msg = serving._whole(creq, "msg_1", "m", _output("<think>plan</think>\n\nThe answer.", "stop"))
    assert msg["content"] == [
        {"type": "thinking", "thinking": "plan", "signature": ""},
        {"type": "text", "text": "The answer."},
    ]
    assert msg["stop_reason"] == "end_turn" and msg["usage"] == {"input_tokens": 3, "output_tokens": 5}
    stopped = serving._whole(creq, "msg_1", "m", _output("<think>x</think>Hi", "stop", stop_reason="END"))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    r1 = AnthropicServingMessages(_Chat(ToolOptions(reasoning_parser="deepseek_r1")))
    cut = r1._whole(creq, "msg_1", "m", _output("<think>long", "length"))  # still thinking at max_tokens
    assert cut["stop_reason"] == "max_tokens" and cut["content"] == [
        {"type": "thinking", "thinking": "long", "signature": ""}
    ]


def test_truncated_any_choice_returns_its_complete_calls():
    serving = AnthropicServingMessages(_Chat(ToolOptions()))
    creq = to_chat_request(_request(tools=[WEATHER], tool_choice={"type": "any"}), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": {"ci'
    msg = serving._whole(creq, "msg_1", "m", _output(text, "length"))
    assert msg["stop_reason"] == "max_tokens"
    assert [(b["type"], b["input"]) for b in msg["content"]] == [("tool_use", {"city": "Oslo"})]


def _parse_events(events: list[str]) -> list[dict]:
    out = []
    for e in events:
        name, data = e.split("\n")[:2]
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        out.append(body)
    return out


def test_block_writer_opens_and_closes_blocks_in_order():
    w = _BlockWriter()
    events = [
        *w.delta({"reasoning_content": "thinking "}),
        *w.delta({"reasoning_content": "more"}),
        *w.delta({"content": "Calling."}),
        *w.delta({"tool_calls": [{"index": 0, "id": "x", "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
        *w.delta({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}),
        *w.delta({"tool_calls": [{"index": 1, "id": "y", "function": {"name": "get_weather", "arguments": "{}"}}]}),
        *w.close(),
    ]
    seq = [
        (e["type"], e.get("index"), (e.get("content_block") or e.get("delta") or {}).get("type"))
        for e in _parse_events(events)
    ]
    assert seq == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
    ]
    parsed = _parse_events(events)
    deltas = [e["delta"] for e in parsed if e.get("index") == 2 and "delta" in e]
    assert "".join(d["partial_json"] for d in deltas) == '{"city": "Oslo"}'


def test_harmony_reply_as_thinking_and_tool_use():
    serving = AnthropicServingMessages(_Chat(ToolOptions(enable_auto_tool_choice=True, tool_call_parser="openai")))
    creq = to_chat_request(_request(tools=[WEATHER], thinking={"type": "adaptive"}), "openai_gptoss")
    reply = (
        "<|channel|>analysis<|message|>Weather needs the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    )
    msg = serving._whole(creq, "msg_1", "m", _output(reply, "stop"))
    assert [b["type"] for b in msg["content"]] == ["thinking", "tool_use"]
    assert msg["content"][0]["thinking"] == "Weather needs the tool."
    assert msg["content"][1]["input"] == {"city": "Oslo"} and msg["stop_reason"] == "tool_use"
