"""Reasoning parsers (``--reasoning-parser``): split a ``<think>`` section off as
``reasoning_content``.

deepseek_r1: the template may open ``<think>`` itself, so text before ``</think>`` is
reasoning, and an output without ``</think>`` is all reasoning (still thinking).
qwen3: reasoning only when the output has ``</think>`` (thinking may be switched off
with ``chat_template_kwargs: {"enable_thinking": false}``); otherwise all content.
"""

from __future__ import annotations

from pagedserve.structured_output.reasoning import REASONING_PARSERS

__all__ = ["ReasoningParser", "get_reasoning_parser"]


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
        self.name = name
        self.start, self.end = REASONING_PARSERS[name]

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of the text generated so far."""
        i = text.find(self.end)
        if i < 0 and not finished and text.lstrip() and self.start.startswith(text.lstrip()):
            return "", ""  # the start marker is still arriving
        if i < 0:
            if self.name == "qwen3" and finished:
                return None, text
            if self.name == "qwen3" and not text.lstrip().startswith(self.start[: len(text.lstrip())]):
                return None, text
            return text.replace(self.start, "", 1).lstrip("\n") if text else "", ""
        reasoning = text[:i].replace(self.start, "", 1).strip("\n")
        return reasoning, text[i + len(self.end) :].lstrip("\n")


def get_reasoning_parser(name: str) -> ReasoningParser:
    return ReasoningParser(name)
