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

:class:`HarmonyReasoning` splits the analysis channel off as reasoning and leaves the
answer's text followed by the raw tool-call messages; :class:`HarmonyToolParser` reads
those calls.  The ``openai_harmony`` package renders and parses this format from token
ids, but loads its vocabulary file from the network on first use; the markers arrive
here as text, so the documented grammar above is read directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagedserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, args_json

__all__ = ["HarmonyMessage", "HarmonyReasoning", "HarmonyToolParser", "harmony_messages"]

_HEAD = re.compile(r"<\|start\|>|<\|channel\|>")
_BODY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    """One message of a reply: ``kind`` is plain (text outside any message), analysis,
    final, commentary, call (a ``functions.*`` recipient) or pending (a header still
    without its body); ``raw`` is the message's own text."""

    kind: str
    body: str
    raw: str
    name: str | None = None


def harmony_messages(text: str) -> list[HarmonyMessage]:
    out: list[HarmonyMessage] = []
    first = _HEAD.search(text)
    lead = text if first is None else text[: first.start()]
    if lead:
        out.append(HarmonyMessage("plain", lead, lead))
    pos = len(text) if first is None else first.start()
    while pos < len(text):
        at = text.find("<|message|>", pos)
        if at < 0:
            out.append(HarmonyMessage("pending", "", text[pos:]))
            break
        header, start = text[pos:at], at + len("<|message|>")
        end = _BODY_END.search(text, start)
        stop = len(text) if end is None else end.start()
        after = len(text) if end is None else (end.start() if end.group() == "<|start|>" else end.end())
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        body, raw = text[start:stop], text[pos:after]
        if recipient is not None and recipient.group(1).startswith("functions."):
            out.append(HarmonyMessage("call", body, raw, recipient.group(1).removeprefix("functions.")))
        elif channel is not None and channel.group(1) in ("analysis", "final", "commentary"):
            out.append(HarmonyMessage(channel.group(1), body, raw))
        else:
            out.append(HarmonyMessage("plain", body, raw))  # an unknown channel: shown as text
        pos = after
    return out


class HarmonyReasoning:
    """The reasoning split of Harmony replies (what ``ReasoningParser.split`` does for
    ``<think>`` formats): the analysis channel is the reasoning; the content is the final
    and commentary text, then the tool-call messages as they were written."""

    name = "openai_gptoss"

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        if not finished:  # a marker still arriving is not text yet
            i = text.rfind("<|")
            if i >= 0 and "|>" not in text[i:]:
                text = text[:i]
            text = text.removesuffix("<")
        reasoning: list[str] = []
        content: list[str] = []
        for m in harmony_messages(text):
            if m.kind == "analysis":
                reasoning.append(m.body)
            elif m.kind == "call":
                content.append(m.raw)
            elif m.kind != "pending":
                content.append(m.body)
        return ("\n\n".join(reasoning) if reasoning else None), "".join(content)


class HarmonyToolParser(ToolParser):
    """Calls from ``functions.*`` recipients; the text of the final and commentary
    channels is the content (the analysis channel is reasoning, see HarmonyReasoning)."""

    name = "openai"
    special_tokens = True
    start = ("<|start|>", "<|channel|>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        msgs = harmony_messages(text)
        content = "".join(m.body for m in msgs if m.kind in ("plain", "final", "commentary"))
        calls = []
        for m in msgs:
            if m.kind == "call":
                args = args_json(m.body)
                if args is None:
                    return text, []
                calls.append(ToolCall(m.name, args))
        return (content.strip() or None) if calls else content, calls
