"""OpenAI's Harmony format (GPT-OSS): the reply is a run of messages, each a header and a
body::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

``analysis`` is the reasoning, ``final`` the answer, ``commentary`` to a ``functions.NAME``
recipient a tool call (the recipient may also stand before the channel:
``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``), and
commentary without a recipient a preamble shown to the user.  The markers are special
tokens, so the output is decoded with them kept.

The ``openai_harmony`` package renders and parses this format from token ids, but loads its
vocabulary file from the network on first use; the markers are plain text here, so the
documented grammar above is read directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, args_json

__all__ = ["HarmonyMessages", "HarmonyToolParser", "parse_harmony"]

_MESSAGE = re.compile(r"(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)", re.DOTALL)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessages:
    """What a Harmony reply says, by kind; ``complete`` is False when a message is cut off
    or the text is not Harmony."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    complete: bool = True


def parse_harmony(text: str) -> HarmonyMessages:
    out = HarmonyMessages()
    pos = 0
    for m in _MESSAGE.finditer(text):
        head, body = m.group(1), m.group(2)
        head = head.replace("<|start|>", "").replace("assistant", "", 1) if "<|start|>" in head else head
        channel = _CHANNEL.search(head)
        recipient = _RECIPIENT.search(head)
        kind = channel.group(1) if channel else None
        if recipient is not None and recipient.group(1).startswith("functions."):
            out.calls.append((recipient.group(1).removeprefix("functions."), body.strip()))
        elif kind == "analysis":
            out.reasoning.append(body)
        elif kind in ("final", "commentary"):
            out.content.append(body)
        else:
            out.complete = False
        pos = m.end()
    if text[pos:].strip():
        out.complete = False  # a header without its message yet, or plain text
    return out


class HarmonyToolParser(ToolParser):
    """Calls from ``functions.*`` recipients; content from the final and commentary
    channels (the analysis channel is the reasoning parser's, ``openai_gptoss``)."""

    name = "openai"
    special_tokens = True
    start = ("<|channel|>", "<|start|>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<|message|>" not in text:
            return text, []
        msgs = parse_harmony(text)
        calls = []
        for name, args in msgs.calls:
            canon = args_json(args)
            if canon is None:
                return "".join(msgs.content) or None, []
            calls.append(ToolCall(name, canon))
        return ("".join(msgs.content) or None), calls

    def marker_at(self, text: str) -> int:
        # The whole reply is Harmony messages: held back, read when it ends.
        return 0 if text.lstrip().startswith("<|") else super().marker_at(text)

    def safe_prefix(self, text: str, sent: int) -> int:
        head = text.lstrip()
        return sent if not head or "<|".startswith(head[:2]) else len(text)
