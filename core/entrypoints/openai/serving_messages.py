"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on top of the
chat-completions machinery (template, tools, reasoning split, tool-call parsing).

A message's content is thinking blocks (with --reasoning-parser), then text, then
tool_use blocks.  ``stop_reason``: end_turn (end of sequence), max_tokens, stop_sequence
(with ``stop_sequence``), tool_use (the model called a tool).  Streaming sends
Anthropic's events: message_start, ping, content_block_start / _delta / _stop per block,
message_delta (stop_reason, usage) and message_stop.  Errors have Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest, to_chat_request
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, to_sampling_params
from pagedserve.entrypoints.openai.serving_base import EventStream
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["AnthropicServingMessages", "add_messages_routes", "anthropic_error_body", "ANTHROPIC_ERROR_TYPES"]

#: Anthropic's error type of each HTTP status.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _parse(cls: type[MessagesRequest], body: bytes) -> MessagesRequest:
    try:
        return cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"The request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise ApiError(400, "The request body must be a JSON object") from None
        param = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "dict[")) and p != "str")
        if err["type"] == "missing":
            raise ApiError(400, f"{param}: Field required", param=param) from None
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from None


class AnthropicServingMessages:
    """The Messages API over an OpenAIServingChat (its template, tools and engine)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _chat_request(self, request: MessagesRequest) -> ChatCompletionRequest:
        return to_chat_request(request, self.chat.reasoning_name())

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        self.chat.model_name(request.model)
        creq = self._chat_request(request)
        if creq.tools:  # the template shows tools whatever the choice; no parser is needed to count
            creq = creq.model_copy(update={"tool_choice": "none"})
        _, ids = self.chat.render(creq)
        return {"input_tokens": len(ids)}

    async def create(self, request: MessagesRequest) -> dict | EventStream:
        chat = self.chat
        model = chat.model_name(request.model)
        creq = self._chat_request(request)
        text, ids, images = chat.render_with_images(creq)
        max_tokens = chat.resolve_max_tokens(request.max_tokens, len(ids), None)
        params = to_sampling_params(creq, max_tokens, chat.generation_defaults)
        chat.constrain_tools(creq, params)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        extra = {"multi_modal_data": images} if images else None  # processed images (pagedserve.multimodal)
        streams = await chat.submit(message_id, [(text, ids)], [params], "messages", extra=extra)
        if request.stream:
            return EventStream(self._stream(creq, message_id, model, streams[0]), streams)
        out = (await chat.collect(streams))[0]
        return self._whole(creq, message_id, model, out)

    # -- answers ----------------------------------------------------------------------------
    @staticmethod
    def _stop(finish: str | None, stop_reason, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of an output's finish."""
        if finish == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return "end_turn", None

    def _whole(self, creq: ChatCompletionRequest, message_id: str, model: str, out) -> dict:
        c = out.outputs[0]
        message, _ = self.chat.chat_output(creq).message(c.text, self.chat.finish_reason(c.finish_reason))
        content: list[dict] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            fn = call["function"]
            content.append(
                {"type": "tool_use", "id": _tool_id(), "name": fn["name"], "input": json.loads(fn["arguments"])}
            )
        stop, seq = self._stop(self.chat.finish_reason(c.finish_reason), c.stop_reason, bool(calls))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": seq,
            "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(c.token_ids)},
        }

    async def _stream(
        self, creq: ChatCompletionRequest, message_id: str, model: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        state = self.chat.chat_output(creq).stream()
        blocks = _BlockWriter()
        output_tokens = 0
        try:
            started = False
            async for out in stream:
                if not started:
                    started = True
                    yield _event(
                        "message_start",
                        {
                            "type": "message_start",
                            "message": {
                                "id": message_id,
                                "type": "message",
                                "role": "assistant",
                                "model": model,
                                "content": [],
                                "stop_reason": None,
                                "stop_sequence": None,
                                "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": 0},
                            },
                        },
                    )
                    yield _event("ping", {"type": "ping"})
                c = out.outputs[0]
                output_tokens = len(c.token_ids)
                finish = self.chat.finish_reason(c.finish_reason)
                for event in blocks.delta(state.delta(c.text, finish is not None, finish)):
                    yield event
                if finish is not None:
                    for event in blocks.close():
                        yield event
                    stop, seq = self._stop(finish, c.stop_reason, state.called)
                    yield _event(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop, "stop_sequence": seq},
                            "usage": {"output_tokens": output_tokens},
                        },
                    )
                    yield _event("message_stop", {"type": "message_stop"})
        except (RequestFailedError, EngineDeadError) as e:
            yield _event("error", anthropic_error_body(500, str(e)))
        finally:
            stream.abort()


class _BlockWriter:
    """Turns chat stream deltas into Anthropic content-block events."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(
            _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, d: dict) -> list[str]:
        events: list[str] = []
        if d.get("reasoning_content"):
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        if d.get("content"):
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "name" in fn:  # a new call
                block = {"type": "tool_use", "id": _tool_id(), "name": fn["name"], "input": {}}
                events += self._open("tool_use", block)
            if fn.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events


def add_messages_routes(app: FastAPI, serving: AnthropicServingMessages, read_body, respond) -> None:
    """Register POST /v1/messages and /v1/messages/count_tokens; every error is answered in
    Anthropic's shape.  ``respond(request, work)`` runs the work under the server's
    disconnect and shutdown handling."""

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status, headers=e.headers)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        try:
            body = _parse(MessagesRequest, await read_body(request))
            return await respond(request, serving.create(body))
        except ApiError as e:
            return error(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = _parse(CountTokensRequest, await read_body(request))
            return JSONResponse(await serving.count_tokens(body))
        except ApiError as e:
            return error(e)
