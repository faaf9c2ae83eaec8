"""Output items of /v1/responses and the server-sent events that build them.

`output_items` shapes a finished chat message (reasoning, text, function calls) into
Responses items; `ResponseEvents` turns the chat stream's deltas into OpenAI's event
sequence: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added`` / ``response.content_part.added`` / deltas / ``...done``
events, and ``response.completed`` (or ``response.incomplete`` / ``response.failed``),
each with its ``sequence_number``.
"""

from __future__ import annotations

import json
import secrets
import uuid

__all__ = ["new_item_id", "output_items", "ResponseEvents"]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, content: list[dict], status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict, status: str, logprobs: list | None) -> list[dict]:
    """Responses items of a chat ``message`` (from ChatOutput.message)."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(new_item_id("rs"), message["reasoning_content"], status))
    # An empty text after the reasoning is no item (a stream never opens one either).
    if message.get("content") is not None and (message["content"] or not message.get("reasoning_content")):
        items.append(_message_item(new_item_id("msg"), [_text_part(message["content"], logprobs)], status))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(_call_item(new_item_id("fc"), new_item_id("call"), fn["name"], fn["arguments"], status))
    return items


class _Open:
    """An item being streamed: its kind, index in ``output`` and text so far."""

    def __init__(self, kind: str, index: int, item: dict) -> None:
        self.kind, self.index, self.item = kind, index, item
        self.text = ""
        self.logprobs: list = []


class ResponseEvents:
    """The SSE text of one streamed response; ``output`` holds the finished items."""

    def __init__(self, obfuscate: bool = False) -> None:
        self.sequence = 0
        self.output: list[dict] = []
        self.obfuscate = obfuscate
        self._open: _Open | None = None
        self._calls: dict[int, _Open] = {}  # chat tool-call index -> its item

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        if self.obfuscate and kind.endswith(".delta"):
            # Pads delta events to a random length so their sizes do not reveal the tokens.
            body["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(16) + 1)
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str, response: dict) -> str:
        return self.event(kind, response=response)

    # -- items -------------------------------------------------------------------------------
    def _start(self, kind: str, item: dict) -> list[str]:
        opened = _Open(kind, len(self.output), item)
        self.output.append(item)
        events = [self.event("response.output_item.added", output_index=opened.index, item=item)]
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            part = _text_part("", None)
        else:
            self._open = opened
            return events
        events.append(
            self.event(
                "response.content_part.added", item_id=item["id"], output_index=opened.index, content_index=0, part=part
            )
        )
        self._open = opened
        return events

    def close(self, status: str = "completed") -> list[str]:
        """Finish the item being streamed, if any."""
        o = self._open
        if o is None:
            return []
        self._open = None
        item_id, at = o.item["id"], o.index
        events = []
        if o.kind == "reasoning":
            part = {"type": "reasoning_text", "text": o.text}
            events.append(
                self.event(
                    "response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0, text=o.text
                )
            )
            events.append(
                self.event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part)
            )
            done = _reasoning_item(item_id, o.text, status)
        elif o.kind == "message":
            part = _text_part(o.text, o.logprobs)
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=at,
                    content_index=0,
                    text=o.text,
                    logprobs=o.logprobs,
                )
            )
            events.append(
                self.event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part)
            )
            done = _message_item(item_id, [part], status)
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=at,
                    name=o.item["name"],
                    arguments=o.text,
                )
            )
            done = _call_item(item_id, o.item["call_id"], o.item["name"], o.text, status)
        self.output[at] = done
        events.append(self.event("response.output_item.done", output_index=at, item=done))
        return events

    def _ensure(self, kind: str, prefix: str) -> list[str]:
        if self._open is not None and self._open.kind == kind:
            return []
        events = self.close()
        if kind == "reasoning":
            item = _reasoning_item(new_item_id(prefix), "", "in_progress")
            item["content"] = []
        else:
            item = _message_item(new_item_id(prefix), [], "in_progress")
        return events + self._start(kind, item)

    def delta(self, d: dict, logprobs: list | None = None) -> list[str]:
        """Events for one chat delta (reasoning_content, content, tool_calls)."""
        events: list[str] = []
        if d.get("reasoning_content"):
            events += self._ensure("reasoning", "rs")
            o = self._open
            o.text += d["reasoning_content"]
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=o.item["id"],
                    output_index=o.index,
                    content_index=0,
                    delta=d["reasoning_content"],
                )
            )
        if d.get("content"):
            events += self._ensure("message", "msg")
            o = self._open
            o.text += d["content"]
            o.logprobs += logprobs or []
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=o.item["id"],
                    output_index=o.index,
                    content_index=0,
                    delta=d["content"],
                    logprobs=logprobs or [],
                )
            )
        for call in d.get("tool_calls") or []:
            events += self._call_delta(call)
        return events

    def _call_delta(self, call: dict) -> list[str]:
        events: list[str] = []
        fn = call.get("function") or {}
        if call.get("id"):  # a new call
            events += self.close()
            item = _call_item(new_item_id("fc"), new_item_id("call"), fn["name"], "", "in_progress")
            events += self._start("function_call", item)
            self._calls[call["index"]] = self._open
        o = self._calls[call["index"]]
        args = fn.get("arguments") or ""
        if args:
            o.text += args
            events.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=o.item["id"], output_index=o.index, delta=args
                )
            )
        return events
