"""The tokenizer and liveness routes vLLM's clients use besides generation.

    POST /tokenize     {"prompt": "..."} or {"messages": [...]}  -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [...]}                          -> {"prompt"}
    GET  /version      {"version": "0.1.0"}
    GET|POST /ping     200 while the engine runs (as /health)
    GET  /ready        200 once the model has answered a request, 503 before

Request and response shapes follow vLLM's (``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest``), so its clients work unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from pagedserve import __version__
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.metrics import INTERNAL_REQUEST_PREFIX
from pagedserve.entrypoints.openai.protocol import ChatMessage, chat_messages, parse_request
from pagedserve.entrypoints.openai.serving_base import OpenAIServing

__all__ = [
    "TokenizeRequest",
    "DetokenizeRequest",
    "OpenAIServingTokenization",
    "Readiness",
    "PROBE_ID",
    "add_tokenize_routes",
]

logger = logging.getLogger(__name__)


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of `prompt` (completions) and `messages` (chat)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization(OpenAIServing):
    """/tokenize and /detokenize over the served model's tokenizer (no engine work)."""

    def tokenize(self, request: TokenizeRequest) -> dict:
        self.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if request.prompt is not None:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        else:
            ids = self._chat_ids(request)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if request.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return body

    def _chat_ids(self, request: TokenizeRequest) -> list[int]:
        if request.continue_final_message and request.add_generation_prompt:
            raise ApiError(
                400, "'continue_final_message' needs 'add_generation_prompt': false.", param="continue_final_message"
            )
        messages = chat_messages(request.messages or [])
        kwargs = dict(request.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "chat_template"):
            if reserved in kwargs:
                raise ApiError(400, f"'chat_template_kwargs' may not set '{reserved}'.", param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                chat_template=request.chat_template or self.chat_template,
                **kwargs,
            )
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        if request.continue_final_message:
            text = _cut_after_final_message(text, messages[-1]["content"])
        return self.tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.model_name(request.model)
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(request.tokens):
            if not 0 <= t < vocab:
                raise ApiError(
                    400, f"'tokens[{i}]' = {t} is outside the vocabulary [0, {vocab}).", param=f"tokens[{i}]"
                )
        return {"prompt": self.tokenizer.decode(request.tokens, skip_special_tokens=False)}


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered conversation up to the end of the last message's content, so that the
    model continues that message instead of closing it (vLLM's continue_final_message)."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ApiError(
            400,
            "'continue_final_message': the last message's content was not found in the rendered template.",
            param="continue_final_message",
        )
    return text[: at + len(final)]


PROBE_ID = INTERNAL_REQUEST_PREFIX + "ready-probe"


class Readiness:
    """Ready once one real generation has come back from the engine: the server's
    start-up runs a one-token probe before it accepts connections, so a load balancer
    polling /ready only routes to a server whose model answers."""

    def __init__(self) -> None:
        self.ready = False

    async def probe(self, engine: Any) -> None:
        from pagedserve.sampling_params import SamplingParams

        stream = None
        try:
            stream = await engine.add_request(
                PROBE_ID, None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=[0]
            )
            async for out in stream:
                if out.finished:
                    self.ready = True
        except Exception:  # noqa: BLE001 - not ready; /health tells whether the engine died
            logger.exception("the readiness probe failed; /ready answers 503")
            self.ready = False
        finally:
            if stream is not None:
                stream.abort()


def add_tokenize_routes(
    app: FastAPI,
    engine: Any,
    served_model_names: list[str],
    chat_template: str | None,
    read_body: Callable[[Request], Awaitable[bytes]],
    readiness: Readiness,
) -> None:
    """Register /tokenize, /detokenize, /version, /ping and /ready on `app`; `read_body`
    reads a request's body under the server's limits."""
    serving = OpenAIServingTokenization(engine, served_model_names, chat_template)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = parse_request(TokenizeRequest, await read_body(request))
        return JSONResponse(serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = parse_request(DetokenizeRequest, await read_body(request))
        return JSONResponse(serving.detokenize(body))

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    async def ping() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    # Two routes, not one with two methods: each gets its own OpenAPI operation id.
    app.add_api_route("/ping", ping, methods=["GET"], name="ping_get")
    app.add_api_route("/ping", ping, methods=["POST"], name="ping_post")

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if readiness.ready and engine.is_running else 503)
