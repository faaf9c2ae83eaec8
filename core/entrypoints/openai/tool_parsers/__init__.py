"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``, vLLM's names).

Each parser finds the calls in a model's free output and returns the text around them as
content.  While streaming, text is sent as content until a parser's ``start`` marker
shows up; from there the rest is held back and sent as tool calls at the end.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

__all__ = ["ToolCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    """Base: ``start`` markers open the tool-call part of an output."""

    name = ""
    start: tuple[str, ...] = ()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); no calls when the output does not parse as calls."""
        raise NotImplementedError

    def marker_at(self, text: str) -> int:
        """Index where the tool-call part starts, or -1 (also -1 while a marker could still be forming)."""
        hits = [text.find(s) for s in self.start if s in text]
        return min(hits) if hits else -1

    def safe_prefix(self, text: str, sent: int) -> int:
        """How much of ``text`` (no marker found yet) may be streamed as content: all but a
        tail that could be the beginning of a marker."""
        longest = max(map(len, self.start))
        for k in range(max(sent, len(text) - longest + 1), len(text)):
            if any(s.startswith(text[k:]) for s in self.start):
                return k
        return len(text)


def _call(obj, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    name = "hermes"
    start = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find("<tool_call>")
        if i < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[i:]):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:i].strip() or None), calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (``; ``-separated),
    optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    start = ("<|python_tag|>", "{")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, dec, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def marker_at(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("<|python_tag|>", "{")):
            return len(text) - len(stripped)
        return -1

    def safe_prefix(self, text: str, sent: int) -> int:
        # Calls are the whole output: nothing is content until it starts otherwise.
        head = text.strip()
        return sent if not head or "<|python_tag|>".startswith(head) else len(text)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral)."""

    name = "mistral"
    start = ("[TOOL_CALLS]",)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find("[TOOL_CALLS]")
        if i < 0:
            return text, []
        try:
            obj = json.loads(text[i + len("[TOOL_CALLS]") :].strip())
        except ValueError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(o) for o in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return (text[:i].strip() or None), calls


class PythonicToolParser(ToolParser):
    """A Python list of calls: ``[get_weather(city="Paris"), now()]`` (Llama 3.2/4 pythonic)."""

    name = "pythonic"
    start = ("[",)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return None, calls

    def marker_at(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("[", "<|python_start|>")) else -1

    def safe_prefix(self, text: str, sent: int) -> int:
        head = text.strip()
        return sent if not head or "<|python_start|>".startswith(head) else len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}") from None
