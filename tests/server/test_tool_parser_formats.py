"""The tool-call formats of newer model families (qwen3_coder, deepseek_v3, granite,
kimi_k2, GPT-OSS Harmony) on replies written in each model's exact format, whole and
streamed in pieces of several sizes (the two must agree); --tool-call-parser auto; and the
complete calls of a "required" array cut short by max_tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.chat_output import ChatOutput
from pagedserve.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser
from pagedserve.entrypoints.openai.tool_parsers.harmony import HarmonyReasoning
from pagedserve.entrypoints.openai.tools import ToolOptions, parse_tool_output, plan_tools


def _fn(name: str, props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": props, "required": required or list(props)},
        },
    }


TOOLS = [
    _fn(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "zip": {"type": "string"},
            "threshold": {"type": "number"},
        },
        ["city"],
    ),
    _fn(
        "search_code",
        {"query": {"type": "string"}, "filters": {"type": "object"}, "exact": {"type": "boolean"}},
        ["query"],
    ),
    _fn("get_time", {"timezone": {"type": "string"}}),
]

# (parser, reply as the model writes it after the generation prompt, content, calls, reasoning)
CASES = [
    (
        "qwen3_coder",
        "I'll look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=units>\ncelsius\n</parameter>\n"
        "<parameter=zip>\n02139\n</parameter>\n<parameter=threshold>\n-2.5\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=search_code>\n<parameter=query>\ndef main():\n    return 0\n</parameter>\n"
        '<parameter=filters>\n{"lang": ["py"], "max": 5}\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n'
        "</function>\n</tool_call>",
        "I'll look that up.",
        [
            (
                "get_weather",
                {"city": "San Francisco, CA", "days": 3, "units": "celsius", "zip": "02139", "threshold": -2.5},
            ),
            (
                "search_code",
                {"query": "def main():\n    return 0", "filters": {"lang": ["py"], "max": 5}, "exact": True},
            ),
        ],
        None,
    ),
    ("qwen3_coder", "Paris is the capital of France.", "Paris is the capital of France.", [], None),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Tokyo", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        '```json\n{"timezone": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [("get_weather", {"city": "Tokyo", "days": 2}), ("get_time", {"timezone": "Asia/Tokyo"})],
        None,
    ),
    (
        "deepseek_v3",  # V3.1's form: the name, then the arguments
        'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "UTC"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me check.",
        [("get_time", {"timezone": "UTC"})],
        None,
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston", "units": "fahrenheit"}}, '
        '{"name": "get_time", "arguments": {"timezone": "America/New_York"}}]',
        None,
        [("get_weather", {"city": "Boston", "units": "fahrenheit"}), ("get_time", {"timezone": "America/New_York"})],
        None,
    ),
    ("granite", "It is 5 pm in Boston.", "It is 5 pm in Boston.", [], None),
    (
        "kimi_k2",
        "I'll check both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        '<|tool_call_argument_begin|>{"timezone": "Asia/Shanghai"}<|tool_call_end|><|tool_calls_section_end|>',
        "I'll check both.",
        [("get_weather", {"city": "Beijing"}), ("get_time", {"timezone": "Asia/Shanghai"})],
        None,
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>The user wants the weather in Tokyo. Use get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Tokyo","days":1}<|call|>',
        None,
        [("get_weather", {"city": "Tokyo", "days": 1})],
        "The user wants the weather in Tokyo. Use get_weather.",
    ),
    (
        "openai",  # the recipient in the header before the channel; no <|call|> (it ended the output)
        "<|channel|>analysis<|message|>Need the time.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"timezone":"UTC"}',
        None,
        [("get_time", {"timezone": "UTC"})],
        "Need the time.",
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>Simple fact.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Paris is the capital of France.",
        "Paris is the capital of France.",
        [],
        "Simple fact.",
    ),
]


def _req(**kw):
    return SimpleNamespace(**{"tools": TOOLS, "tool_choice": None, "parallel_tool_calls": None, **kw})


def _shaper(parser: str) -> ChatOutput:
    plan = plan_tools(_req(), ToolOptions(enable_auto_tool_choice=True, tool_call_parser=parser))
    return ChatOutput(plan, HarmonyReasoning() if parser == "openai" else None)


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize("parser, text, content, calls, reasoning", CASES)
def test_whole_reply(parser, text, content, calls, reasoning):
    msg, finish = _shaper(parser).message(text, "stop")
    assert msg["content"] == content
    assert _calls(msg["tool_calls"]) == calls
    assert msg.get("reasoning_content") == reasoning
    assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("parser, text, content, calls, reasoning", CASES)
def test_streamed_reply_equals_whole(parser, text, content, calls, reasoning, size):
    shaper = _shaper(parser)
    whole, whole_finish = shaper.message(text, "stop")
    state, deltas = shaper.stream(), []
    for end in range(size, len(text) + size, size):
        last = end >= len(text)
        d = state.delta(text[:end], last, "stop" if last else None)
        if d:
            deltas.append(d)
    streamed_content = "".join(d.get("content", "") for d in deltas)
    streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed_content.strip() == (whole["content"] or "")
    assert (streamed_reasoning or None) == whole.get("reasoning_content")
    assert _calls(streamed_calls) == _calls(whole["tool_calls"])
    assert [c["index"] for c in streamed_calls] == list(range(len(streamed_calls)))
    assert shaper.finish_reason("stop", state.called) == whole_finish
    for marker in ("<tool_call>", "<｜", "<|tool", "<|channel|>", "<|start|>", "<|message|>"):
        assert marker not in streamed_content  # markers never leak as content


@pytest.mark.parametrize(
    "parser, text",
    [
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # cut off
        ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": '),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"),
        ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {'),
        ("openai", '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"timezone'),
    ],
)
def test_unfinished_calls_are_not_calls(parser, text):
    content, calls = get_tool_parser(parser, TOOLS).extract(text)
    assert calls == [] and content


@pytest.mark.parametrize(
    "template, parser",
    [
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "openai"),
        ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>", "qwen3_coder"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] }}", "deepseek_v3"),
        ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
        ("<|start_of_role|>assistant<|end_of_role|><|tool_call|>{{ tool_calls | tojson }}", "granite"),
        ("<|start_of_role|>assistant<|end_of_role|><|tool_call|><tool_call>{{ tc | tojson }}</tool_call>", "hermes"),
        ("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", "hermes"),
        ("[TOOL_CALLS] {{ calls }}", "mistral"),
        ("{{ '<|im_start|>' + message.role }}", None),
    ],
)
def test_auto_detects_the_format_from_the_template(template, parser):
    assert detect_tool_parser(template) == parser
    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="auto")
    if parser is None:
        with pytest.raises(ValueError, match="--tool-call-parser auto"):
            options.resolved(template)
    else:
        assert options.resolved(template).tool_call_parser == parser


def test_special_token_formats_keep_special_tokens():
    from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedserve.sampling_params import SamplingParams

    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for parser, keep in [("kimi_k2", True), ("openai", True), ("hermes", False), ("qwen3_coder", False)]:
        mixin = ChatToolsMixin()
        mixin.tool_options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
        params = SamplingParams(max_tokens=5)
        mixin.constrain_tools(ChatCompletionRequest.model_validate(body), params)
        assert params.skip_special_tokens is not keep, parser


def _required_plan():
    return plan_tools(_req(tool_choice="required"), ToolOptions())


def test_truncated_required_array_keeps_its_complete_calls():
    plan = _required_plan()
    full = [
        {"name": "get_time", "parameters": {"timezone": "UTC"}},
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "get_time", "parameters": {"timezone": "CET"}},
    ]
    text = json.dumps(full)
    cut = text[: text.index('"CET"')]  # max_tokens hit inside the third call
    content, calls = parse_tool_output(plan, cut)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(f["name"], f["parameters"]) for f in full[:2]]
    # Nothing complete yet: the text stays content.
    assert parse_tool_output(plan, '[{"name": "get_ti') == ('[{"name": "get_ti', [])

    shaper = ChatOutput(plan, None)
    msg, finish = shaper.message(cut, "length")
    assert finish == "length" and msg["content"] is None and len(msg["tool_calls"]) == 2
    state = shaper.stream()
    deltas = [state.delta(cut[:k], k == len(cut), "length" if k == len(cut) else None) for k in range(1, len(cut) + 1)]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert _calls(streamed) == _calls(msg["tool_calls"])
    assert not any("content" in d for d in deltas)


def test_serve_with_auto_parser(server_factory, tiny_llama, tiny_server_args, tmp_path):
    """`--tool-call-parser auto` starts with a template that tells its format and stops the
    start, naming the flag, with one that does not."""
    import subprocess
    import sys

    template = tmp_path / "hermes.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        '{% if tools %}Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call>{% endif %}'
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    auto = ["--enable-auto-tool-choice", "--tool-call-parser", "auto"]
    server = server_factory(str(tiny_llama), [*tiny_server_args, *auto, "--chat-template", str(template)])
    r = server.openai().chat.completions.create(
        model=str(tiny_llama), messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=3
    )
    assert r.choices[0].finish_reason in ("stop", "length")  # "auto" accepted: a parser was chosen
    failed = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_llama), *tiny_server_args, *auto],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0 and "--tool-call-parser auto" in failed.stderr
