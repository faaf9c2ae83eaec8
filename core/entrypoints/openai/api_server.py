"""The FastAPI application of the OpenAI-compatible server.

    app = build_app(AsyncLLMEngine(LLMEngine(config)), ServerSettings(["my-model"]))

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics.  Every error is OpenAI's JSON error shape; a bad request is always a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.errors import ApiError, error_body
from pagedserve.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ReplicaCollector, ServerMetrics
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.entrypoints.openai.serving_base import EventStream
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

__all__ = ["ServerSettings", "build_app"]

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """What the HTTP layer needs besides the engine.

    served_model_names: names accepted in a request's `model` (the first is reported).
    api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>`.
    max_body_bytes: larger request bodies are refused with 413.
    chat_template: template text overriding the model's (read from --chat-template).
    """

    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    chat_template: str | None = None
    #: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser (a ToolOptions)
    tool_options: object | None = None


class _ApiKeyMiddleware:
    """Refuses /v1 requests without the right bearer token, before any body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # Constant-time comparison: response timing must not leak the key.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(scope):
            response = JSONResponse(error_body("Incorrect or missing API key.", code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _EventStreamResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (done, error, client gone)."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without buffering it."""
    too_large = ApiError(413, f"The request body is larger than the server's limit of {limit} bytes "
                         "(--max-body-size).", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Awaitable[dict | EventStream]) -> Response:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; this is for the access log
    result = task.result()
    if isinstance(result, EventStream):
        if watcher.done() and not watcher.cancelled():
            result.abort()
            return Response(status_code=499)
        return _EventStreamResponse(result)
    return JSONResponse(result)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app; starts the engine thread on startup and stops it on shutdown.

    ``engine`` may also be a `DataParallelRouter` (same interface): then /metrics adds
    per-replica series and /health answers with the replicas' state.
    """
    names = settings.served_model_names
    metrics = ServerMetrics(engine.stats, names[0])
    if hasattr(engine, "replica_status"):
        metrics.registry.register(ReplicaCollector(engine.replica_status, names[0]))
    engine.on_request_finished = metrics.observe_finished
    completions = OpenAIServingCompletion(engine, names, settings.chat_template)
    chat = OpenAIServingChat(engine, names, settings.chat_template)
    if settings.tool_options is not None:
        chat.tool_options = settings.tool_options
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("engine started; serving %s", ", ".join(names))
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            logger.info("engine stopped")

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if settings.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=settings.api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal_server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if hasattr(engine, "health"):  # data-parallel: {"status": "ok" | "degraded" | ..., replicas}
            status, body = engine.health()
            return JSONResponse(body, status_code=status)
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
                "root": names[0], "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        return model_card(completions.model_name(model))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_body(request, settings.max_body_bytes))
        return await _respond(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_body(request, settings.max_body_bytes))
        return await _respond(request, chat.create(body))

    return app
