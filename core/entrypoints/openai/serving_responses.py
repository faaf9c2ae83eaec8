"""POST /v1/responses (OpenAI's Responses API) over the chat-completions path, and the
stored responses: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
POST /v1/responses/{id}/cancel.

A response is generated as the chat completion of its conversation (chat_bridge), so
greedy text equals /v1/chat/completions' for the same messages; tools, tool_choice,
text.format and the reasoning parser are the chat endpoint's.  ``max_output_tokens``
reached makes the response ``incomplete`` with ``incomplete_details.reason``
``"max_output_tokens"``.  ``background: true`` answers at once with a ``queued``
response, generates it in a task and stores the result (poll GET; cancel stops it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.async_engine import EngineDeadError, RequestFailedError
from pagedserve.entrypoints.openai.chat_bridge import ChatRun, start_chat
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import parse_request
from pagedserve.entrypoints.openai.responses_output import ResponseEvents, new_item_id, output_items
from pagedserve.entrypoints.openai.responses_protocol import (
    RENAME,
    ResponsesRequest,
    chat_body,
    chat_messages_of,
    check_request,
    items_of,
    located,
)
from pagedserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedserve.entrypoints.openai.serving_base import EventStream
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["OpenAIServingResponses", "add_responses_routes"]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _with_ids(items: list[dict]) -> list[dict]:
    """Input items as stored and listed: each with an ``id`` and a ``type``, a message's
    text as content parts (input_text, or output_text for the assistant's)."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        stored = {"id": item.get("id") or new_item_id(_ID_PREFIX.get(kind, "item")), **item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            text = {"type": part, "text": item["content"], **({"annotations": []} if part == "output_text" else {})}
            stored["content"] = [text]
        out.append(stored)
    return out


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response with id '{response_id}' found.", param="response_id", code="not_found")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._running: dict[str, asyncio.Future] = {}  # background responses being generated

    # -- create -------------------------------------------------------------------------------
    def _conversation(self, r: ResponsesRequest) -> list[dict]:
        """Inherited items (previous_response_id) and this request's input."""
        items = items_of(r.input)
        if r.previous_response_id is None:
            return items
        prev = self.store.get(r.previous_response_id)
        if prev is None:
            raise ApiError(
                404,
                f"Previous response with id '{r.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [*prev.input_items, *prev.response["output"], *items]

    async def create(self, r: ResponsesRequest) -> dict | EventStream:
        check_request(r)
        if r.background and self.store.config.max_entries == 0:
            raise ApiError(
                400, "'background' needs stored responses (--responses-store-max-entries is 0).", param="background"
            )
        model = self.chat.model_name(r.model)
        items = _with_ids(self._conversation(r))
        origins: list[str] = []
        messages = chat_messages_of(items, r.instructions, origins=origins)
        response_id = new_item_id("resp")
        try:
            # messages[i] is renamed after the item it came from (an image part's error, say).
            rename = {k: v for k, v in RENAME.items() if k != "messages"}
            run = await start_chat(self.chat, chat_body(r, model, messages), response_id, rename)
        except ApiError as e:
            raise located(e, origins) from None
        base = self._base(r, response_id, model)
        if r.stream:
            return EventStream(self._stream(r, run, base, items), [run.stream])
        if r.background:
            return self._start_background(r, run, base, items)
        body = self._whole(run, base, (await self.chat.collect([run.stream]))[0])
        self._keep(r, body, items)
        return body

    def _whole(self, run: ChatRun, base: dict, out) -> dict:
        c = out.outputs[0]
        finish = self.chat.finish_reason(c.finish_reason)
        message, _ = run.shaper.message(c.text, finish)
        status = "incomplete" if finish == "length" else "completed"
        logprobs = self._logprobs(run, c.token_ids, c.logprobs)
        return self._finished(base, status, output_items(message, status, logprobs), out, message)

    # -- background responses -----------------------------------------------------------------
    def _start_background(self, r: ResponsesRequest, run: ChatRun, base: dict, items: list[dict]) -> dict:
        queued = {**base, "status": "queued"}
        self.store.put(base["id"], StoredResponse(queued, items))
        task = asyncio.ensure_future(self._background(run, base, items))
        self._running[base["id"]] = task
        task.add_done_callback(lambda _: self._running.pop(base["id"], None))
        return queued

    async def _background(self, run: ChatRun, base: dict, items: list[dict]) -> None:
        try:
            out = (await self.chat.collect([run.stream]))[0]
        except ApiError as e:
            failed = {**base, "status": "failed", "error": {"code": "server_error", "message": e.message}}
            self.store.put(base["id"], StoredResponse(failed, items))
            return
        except asyncio.CancelledError:
            return  # cancel() stored the cancelled response
        self.store.put(base["id"], StoredResponse(self._whole(run, base, out), items))

    def _base(self, r: ResponsesRequest, response_id: str, model: str) -> dict:
        d = self.chat.generation_defaults
        reasoning = r.reasoning or {}
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": bool(r.background),
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "metadata": r.metadata or {},
            "model": model,
            "output": [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "prompt_cache_key": r.prompt_cache_key,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "safety_identifier": r.safety_identifier,
            "service_tier": "default",
            "store": r.store is not False,
            "temperature": r.temperature if r.temperature is not None else d.get("temperature", 1.0),
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
            "tools": r.tools or [],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": r.top_p if r.top_p is not None else d.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "user": r.user,
        }

    def _usage(self, out, reasoning: str | None) -> dict:
        completion = len(out.outputs[0].token_ids)
        thought = len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        prompt = len(out.prompt_token_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(thought, completion)},
            "total_tokens": prompt + completion,
        }

    def _finished(self, base: dict, status: str, output: list[dict], out, message: dict) -> dict:
        return {
            **base,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": self._usage(out, message.get("reasoning_content")),
        }

    def _logprobs(self, run: ChatRun, token_ids, entries) -> list | None:
        if not run.request.logprobs or entries is None:
            return None
        return self.chat.chat_logprobs(token_ids, entries, run.request.top_logprobs or 0)

    def _keep(self, r: ResponsesRequest, body: dict, items: list[dict]) -> None:
        if r.store is not False:
            self.store.put(body["id"], StoredResponse(body, items))

    async def _stream(self, r: ResponsesRequest, run: ChatRun, base: dict, items: list[dict]) -> AsyncIterator[str]:
        opts = r.stream_options or {}
        ev = ResponseEvents(obfuscate=bool(opts.get("include_obfuscation")))
        state = run.shaper.stream()
        yield ev.lifecycle("response.created", base)
        yield ev.lifecycle("response.in_progress", base)
        sent = 0
        text_so_far = ""
        final = None
        try:
            async for out in run.stream:
                c = out.outputs[0]
                finish = self.chat.finish_reason(c.finish_reason)
                entries = None if c.logprobs is None else c.logprobs[sent:]
                logprobs = self._logprobs(run, c.token_ids[sent:], entries)
                sent = len(c.token_ids)
                text_so_far = c.text
                for event in ev.delta(state.delta(c.text, finish is not None, finish), logprobs):
                    yield event
                final = out
        except (RequestFailedError, EngineDeadError) as e:
            for event in ev.close("incomplete"):
                yield event
            failed = {
                **base,
                "status": "failed",
                "output": ev.output,
                "error": {"code": "server_error", "message": str(e)},
            }
            yield ev.lifecycle("response.failed", failed)
            return
        finally:
            run.stream.abort()
        finish = self.chat.finish_reason(final.outputs[0].finish_reason) if final else None
        status = "incomplete" if finish == "length" else "completed"
        for event in ev.close(status):
            yield event
        message, _ = run.shaper.message(text_so_far, finish)
        body = self._finished(base, status, ev.output, final, message)
        self._keep(r, body, items)
        yield ev.lifecycle("response.completed" if status == "completed" else "response.incomplete", body)

    # -- stored responses ---------------------------------------------------------------------
    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        task = self._running.pop(response_id, None)
        if task is not None:
            task.cancel()  # its engine request is aborted
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def cancel(self, response_id: str) -> dict:
        """Stop a background response; one already finished is answered as it is."""
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if not stored.response.get("background"):
            raise ApiError(400, "Only responses created with background=true can be cancelled.", param="response_id")
        task = self._running.pop(response_id, None)
        if task is None:
            return stored.response
        task.cancel()  # its engine request is aborted
        cancelled = {**stored.response, "status": "cancelled"}
        self.store.put(response_id, StoredResponse(cancelled, stored.input_items))
        return cancelled

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if not 1 <= limit <= 100:
            raise ApiError(400, f"'limit' must be between 1 and 100, got {limit}.", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"'order' must be 'asc' or 'desc', got {order!r}.", param="order")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise ApiError(400, f"'after' names no input item of this response: {after!r}.", param="after")
            items = items[at + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses, read_body, respond) -> None:
    """Register the /v1/responses routes; ``respond(request, work)`` runs the work under
    the server's disconnect and shutdown handling."""

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = parse_request(ResponsesRequest, await read_body(request))
        return await respond(request, serving.create(body))

    def no_query(request: Request, allowed: set[str]) -> None:
        extra = sorted(set(request.query_params) - allowed)
        if extra:
            raise ApiError(400, f"Query parameter '{extra[0]}' is not supported.", param=extra[0])

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict:
        no_query(request, {"stream"})
        if request.query_params.get("stream", "false") != "false":
            raise ApiError(400, "'stream' is not supported when retrieving a stored response.", param="stream")
        return serving.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return serving.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        return serving.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict:
        no_query(request, {"limit", "order", "after"})
        return serving.input_items(response_id, limit, order, after)
