"""The assistant message of a chat completion, whole or as stream deltas, with a
reasoning section split off (``reasoning_content``) and tool calls parsed out
(``tool_calls``) according to the request's ToolPlan."""

from __future__ import annotations

from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedserve.entrypoints.openai.tools import ToolPlan, parse_tool_output, tool_call_dicts

__all__ = ["ChatOutput", "ChatStreamState"]


class ChatOutput:
    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self.reasoning = reasoning

    def split(self, text: str, finished: bool) -> tuple[str | None, str]:
        return self.reasoning.split(text, finished) if self.reasoning else (None, text)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI answers "tool_calls" when the model chose to call; a named choice stays "stop".
        if reason == "stop" and called and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole `message` object and the finish_reason to report."""
        reasoning, content = self.split(text, True)
        calls = []
        if self.plan.mode != "none" and (reason != "length" or self.plan.mode == "required"):
            content, calls = parse_tool_output(self.plan, content)
        msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = tool_call_dicts(calls)
        elif self.plan.mode != "none":
            msg["tool_calls"] = []
        return msg, self.finish_reason(reason, bool(calls))

    def stream(self) -> ChatStreamState:
        return ChatStreamState(self)


class ChatStreamState:
    """What one choice has sent; ``delta`` gives the next `delta` object (maybe empty)."""

    def __init__(self, out: ChatOutput) -> None:
        self.out = out
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_args = 0
        self.named_opened = False
        self.called = False

    def delta(self, text: str, finished: bool, reason: str | None) -> dict:
        reasoning, content = self.out.split(text, finished)
        d: dict = {}
        if reasoning:
            new = reasoning[self.sent_reasoning :]
            if new:
                d["reasoning_content"] = new
                self.sent_reasoning = len(reasoning)
        plan = self.out.plan
        if plan.mode == "none" or reason == "length" and plan.mode not in ("named", "required"):
            self._content(d, content, len(content))
        elif plan.mode == "named":
            self._named(d, content)
        elif plan.mode == "required":
            if finished:
                self._finish_calls(d, content)
        else:
            self._auto(d, content, finished)
        return d

    def _content(self, d: dict, content: str, upto: int) -> None:
        new = content[self.sent_content : upto]
        if new:
            d["content"] = new
            self.sent_content = upto

    def _named(self, d: dict, content: str) -> None:
        new = content[self.sent_args :]
        if not self.named_opened and content:
            (call,) = tool_call_dicts(parse_tool_output(self.out.plan, "")[1], stream=True)
            call["function"]["arguments"] = new
            d["tool_calls"] = [call]
            self.named_opened = self.called = True
        elif new:
            d["tool_calls"] = [{"index": 0, "function": {"arguments": new}}]
        self.sent_args = len(content)

    def _finish_calls(self, d: dict, content: str) -> None:
        rest, calls = parse_tool_output(self.out.plan, content)
        if calls:
            d["tool_calls"] = tool_call_dicts(calls, stream=True)
            self.called = True
            if rest and len(rest) > self.sent_content:
                d["content"] = rest[self.sent_content :]
        else:
            self._content(d, content, len(content))

    def _auto(self, d: dict, content: str, finished: bool) -> None:
        parser = self.out.plan.parser
        if finished:
            self._finish_calls(d, content)
            return
        at = parser.marker_at(content)
        if at >= 0:
            self._content(d, content, at)  # the text before the calls; the calls wait for the end
            return
        self._content(d, content, parser.safe_prefix(content, self.sent_content))
