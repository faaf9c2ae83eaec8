"""What every tool-call parser shares: the call record, the parser interface and the
streaming rule (text is content until a parser's ``start`` marker shows up; from there the
rest is held back and parsed as calls when the output ends)."""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["ToolCall", "ToolParser", "json_call", "args_json"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    """Base: ``start`` markers open the tool-call part of an output.

    ``tools``: the request's tools (chat-completions shape), for formats whose argument
    values are typed by the tool's schema.  ``special_tokens``: the format's markers are
    special tokens, so the output is decoded with them kept.
    """

    name = ""
    start: tuple[str, ...] = ()
    special_tokens = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.schemas: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") or {}

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


def json_call(obj, args_key: str = "arguments") -> ToolCall | None:
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


def args_json(text: str) -> str | None:
    """An arguments text as canonical JSON of an object (empty text: ``{}``), or None."""
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
