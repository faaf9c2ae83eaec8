"""Tool-call formats of newer model families (vLLM's parser names).

qwen3_coder (Qwen3-Coder, Qwen3.5): XML, argument values typed by the tool's schema::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

deepseek_v3 (DeepSeek-V3 and R1; also V3.1's shorter form)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    (V3.1: <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>)

granite (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``

kimi_k2 (Kimi-K2)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, args_json, json_call

__all__ = ["Qwen3CoderToolParser", "DeepSeekV3ToolParser", "GraniteToolParser", "KimiK2ToolParser"]


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find("<tool_call>")
        if i < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[i:]):
            m = self._function.match(body)
            if m is None:
                return text, []
            name = m.group(1).strip()
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args = {}
            for key, raw in self._param.findall(m.group(2)):
                key = key.strip()
                args[key] = self._value(raw, props.get(key))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return (text[:i].strip() or None), calls

    @staticmethod
    def _value(raw: str, schema: Any) -> Any:
        """A parameter's text as the type its schema names (the template writes one
        newline on each side of the value)."""
        value = raw.removeprefix("\n").removesuffix("\n")
        kinds = schema.get("type") if isinstance(schema, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if value.strip().lower() == "null" and ("null" in kinds or not kinds):
            return None
        if kinds and all(k == "string" for k in kinds):
            return value
        s = value.strip()
        if "integer" in kinds and re.fullmatch(r"[-+]?\d+", s):
            return int(s)
        if "number" in kinds:
            try:
                f = float(s)
                return int(f) if f.is_integer() and re.fullmatch(r"[-+]?\d+", s) else f
            except ValueError:
                pass
        if "boolean" in kinds and s.lower() in ("true", "false"):
            return s.lower() == "true"
        try:
            return json.loads(s)  # objects, arrays, and values of untyped parameters
        except ValueError:
            pass
        if kinds and any(k in ("object", "array") for k in kinds):
            try:
                return ast.literal_eval(s)  # Python-style literals some outputs use
            except (ValueError, SyntaxError):
                pass
        return value


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    special_tokens = True
    start = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    _call = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _v3_args = re.compile(r"^(.*?)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = self.marker_at(text)
        if i < 0:
            return text, []
        rest = text[i:].replace("<｜tool▁calls▁begin｜>", "").replace("<｜tool▁calls▁end｜>", "")
        calls = []
        for head, body in self._call.findall(rest):
            rest = rest.replace(f"<｜tool▁call▁begin｜>{head}<｜tool▁sep｜>{body}<｜tool▁call▁end｜>", "", 1)
            m = self._v3_args.match(body)
            if head.strip() == "function" and m is not None:  # V3: type, then name and a json block
                name, args = m.group(1).strip(), args_json(m.group(2))
            else:  # V3.1: name, then the arguments
                name, args = head.strip(), args_json(body)
            if not name or args is None:
                return text, []
            calls.append(ToolCall(name, args))
        if not calls or rest.strip():
            return text, []  # an unfinished or malformed call
        return (text[:i].strip() or None), calls


class GraniteToolParser(ToolParser):
    name = "granite"
    special_tokens = True
    start = ("<|tool_call|>", "<tool_call>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = self.marker_at(text)
        body = text[i:] if i >= 0 else text.lstrip()
        body = body.removeprefix("<|tool_call|>").removeprefix("<tool_call>").strip()
        if not body.startswith("["):
            return text, []
        try:
            items = json.loads(body)
        except ValueError:
            return text, []
        calls = [json_call(o) for o in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return text, []
        return ((text[:i].strip() or None) if i >= 0 else None), calls

    def marker_at(self, text: str) -> int:
        at = super().marker_at(text)
        if at >= 0:
            return at
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else -1


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    special_tokens = True
    start = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    _call = re.compile(
        r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL
    )
    _id = re.compile(r"^(?:functions\.)?(.+?)(?::\d+)?$")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = self.marker_at(text)
        if i < 0:
            return text, []
        rest = text[i:].replace("<|tool_calls_section_begin|>", "").replace("<|tool_calls_section_end|>", "")
        calls = []
        for m in self._call.finditer(rest):
            name, args = self._id.match(m.group(1)).group(1), args_json(m.group(2))
            if args is None:
                return text, []
            calls.append(ToolCall(name, args))
        if not calls or self._call.sub("", rest).strip():
            return text, []
        return (text[:i].strip() or None), calls
