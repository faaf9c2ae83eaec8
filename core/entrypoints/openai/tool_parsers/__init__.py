"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``, vLLM's names):
hermes, llama3_json, mistral, pythonic (here), qwen3_coder, deepseek_v3, granite, kimi_k2
(formats.py) and openai, GPT-OSS's Harmony (harmony.py).  ``--tool-call-parser auto``
picks one from the chat template (:func:`detect_tool_parser`).

Each parser finds the calls in a model's free output and returns the text around them as
content.  While streaming, text is sent as content until a parser's ``start`` marker
shows up; from there the rest is held back and sent as tool calls at the end.
"""

from __future__ import annotations

import ast
import json
import re

from pagedserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, json_call
from pagedserve.entrypoints.openai.tool_parsers.formats import (
    DeepSeekV3ToolParser,
    GraniteToolParser,
    KimiK2ToolParser,
    Qwen3CoderToolParser,
)
from pagedserve.entrypoints.openai.tool_parsers.harmony import HarmonyToolParser

__all__ = ["ToolCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser", "detect_tool_parser"]


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
                call = json_call(json.loads(body))
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
            call = json_call(obj, "parameters")
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
        calls = [json_call(o) for o in items]
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
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
        Qwen3CoderToolParser,
        DeepSeekV3ToolParser,
        GraniteToolParser,
        KimiK2ToolParser,
        HarmonyToolParser,
    )
}

#: Marks in a chat template that tell its tool-call format (all of the first, none of the
#: second), most specific first: the Qwen3-Coder template also writes Hermes' ``<tool_call>``,
#: Granite 4 writes ``<|tool_call|>`` as a role but calls in Hermes' format.
_TEMPLATE_MARKS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("openai", ("<|channel|>", "<|message|>"), ()),
    ("qwen3_coder", ("<function=", "<parameter="), ()),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>",), ()),
    ("kimi_k2", ("<|tool_calls_section_begin|>",), ()),
    ("granite", ("<|tool_call|>",), ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",), ()),
    ("pythonic", ("<|python_start|>",), ()),
    ("hermes", ("<tool_call>",), ()),
    ("llama3_json", ("<|python_tag|>",), ()),
)


def detect_tool_parser(template: str | None) -> str | None:
    """The tool-call parser a chat template's format calls for, or None when it cannot be told."""
    for name, marks, unless in _TEMPLATE_MARKS:
        if template and all(m in template for m in marks) and not any(m in template for m in unless):
            return name
    return None


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """The parser named ``name`` for a request's ``tools`` (chat-completions shape)."""
    try:
        return TOOL_PARSERS[name](tools)
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}") from None
