"""Tool calling in chat completions: checking `tools` / `tool_choice`, the constraint that
enforces "required" and named choices, tool fields of history messages, and the
`tool_calls` of a response.

- "none": tools are shown to the template, output is plain content.
- "auto": free output, parsed by the server's `--tool-call-parser` (needs
  `--enable-auto-tool-choice`, else 400 as in vLLM).
- "required": output constrained to a JSON array of `{"name", "parameters"}` objects,
  one schema per tool; `finish_reason: "tool_calls"`.  When max_tokens cuts the array
  short, its complete calls are still returned as calls (`finish_reason: "length"`).
- a named function: output constrained to that function's parameters schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.structured import checked_params
from pagedserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
)
from pagedserve.structured_output import StructuredOutputsParams

__all__ = ["ToolOptions", "ToolPlan", "plan_tools", "message_tool_fields", "tool_call_dicts", "complete_items"]


@dataclass
class ToolOptions:
    """Server settings: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser and self.tool_call_parser != "auto":
            get_tool_parser(self.tool_call_parser)  # ValueError for an unknown name
        if self.reasoning_parser:
            from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)

    def resolved(self, template: str | None) -> ToolOptions:
        """These options with ``--tool-call-parser auto`` replaced by the parser the chat
        template's format calls for; ValueError when the template does not tell."""
        if self.tool_call_parser != "auto":
            return self
        name = detect_tool_parser(template)
        if name is None:
            raise ValueError(
                "--tool-call-parser auto: the chat template does not show a known tool-call format; "
                f"name the parser instead ({', '.join(TOOL_PARSERS)})"
            )
        return replace(self, tool_call_parser=name)


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # as the template sees them
    function: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps only the first call under "auto"


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "'tools' must be a non-empty list.", param="tools")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(
                400, f'\'tools[{i}]\' must be {{"type": "function", "function": {{"name": ...}}}}.', param=f"tools[{i}]"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(
                400,
                f"'tools[{i}].function.parameters' must be a JSON schema object.",
                param=f"tools[{i}].function.parameters",
            )
        checked_params({"json": params}, f"tools[{i}].function.parameters")  # a schema that cannot compile: 400
        if fn["name"] in names:
            raise ApiError(400, f"'tools' names the function {fn['name']!r} twice.", param="tools")
        names.add(fn["name"])
    return tools


def _params_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def plan_tools(request: Any, options: ToolOptions) -> ToolPlan:
    """How the request's tools are used; ApiError(400) for bad tools or an unavailable choice."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return ToolPlan("none")
    tools = _check_tools(request.tools)
    defaulted = choice is None
    if defaulted:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise ApiError(400, f"'tool_choice' must name a function of 'tools'; got {name!r}.", param="tool_choice")
        so = checked_params({"json": _params_schema(match[0]), "disable_any_whitespace": True}, "tool_choice")
        return ToolPlan("named", tools, name, so)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _params_schema(t),
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(
            "required", tools, constraint=checked_params({"json": schema, "disable_any_whitespace": True}, "tools")
        )
    if choice == "auto":
        if not options.enable_auto_tool_choice or not options.tool_call_parser:
            where = "'tools' with tool_choice \"auto\" (the default)" if defaulted else '"auto" tool choice'
            raise ApiError(
                400,
                f"{where} requires --enable-auto-tool-choice and --tool-call-parser to be set on the server",
                param="tools" if defaulted else "tool_choice",
            )
        return ToolPlan(
            "auto",
            tools,
            parser=get_tool_parser(options.tool_call_parser, tools),
            parallel=request.parallel_tool_calls is not False,
        )
    raise ApiError(
        400,
        f"'tool_choice' must be 'none', 'auto', 'required' or a named function; got {choice!r}.",
        param="tool_choice",
    )


def message_tool_fields(message: Any, out: dict, index: int) -> dict:
    """Add a history message's tool fields as chat templates expect them (HF convention:
    `tool_calls[].function.arguments` as an object, `tool_call_id` on tool turns)."""
    if message.tool_calls is not None:
        where = f"messages[{index}].tool_calls"
        if message.role != "assistant" or not isinstance(message.tool_calls, list):
            raise ApiError(400, f"'{where}' must be a list on an assistant message.", param=where)
        calls = []
        for j, c in enumerate(message.tool_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"'{where}[{j}]' must have a function with a name.", param=f"{where}[{j}]")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ApiError(
                        400, f"'{where}[{j}].function.arguments' is not JSON.", param=f"{where}[{j}].function.arguments"
                    ) from None
            calls.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def parse_tool_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output under ``plan``."""
    if plan.mode == "named":
        return None, [ToolCall(plan.function, text)]
    if plan.mode == "required":
        items = complete_items(text)
        if not items:
            return text, []  # cut short by max_tokens before the first call was complete
        return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
    if plan.mode == "auto":
        content, calls = plan.parser.extract(text)
        return content, calls if plan.parallel else calls[:1]
    return text, []


def complete_items(text: str) -> list[dict]:
    """The complete calls of a "required" output's JSON array, also when max_tokens cut
    the array short (the calls before the cut are whole; the one being written is not)."""
    try:
        items = json.loads(text)
        return items if isinstance(items, list) else []
    except ValueError:
        pass
    body = text.lstrip()
    if not body.startswith("["):
        return []
    dec, pos, items = json.JSONDecoder(), 1, []
    while True:
        while pos < len(body) and body[pos] in " \t\n\r,":
            pos += 1
        try:
            item, pos = dec.raw_decode(body, pos)
        except ValueError:
            break
        if not isinstance(item, dict) or "name" not in item or "parameters" not in item:
            break
        items.append(item)
    return items


def tool_call_dicts(calls: list[ToolCall], stream: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` entries (with `index` when streamed)."""
    out = []
    for i, c in enumerate(calls):
        d = {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        if stream:
            d = {"index": i, **d}
        out.append(d)
    return out
