"""The FastAPI application of the OpenAI-compatible server.

    app = build_app(AsyncLLMEngine(LLMEngine(config)), ServerSettings(["my-model"]))

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, POST /v1/responses
(+ GET/DELETE /v1/responses/{id}, its /input_items and /cancel), POST /v1/messages,
POST /v1/messages/count_tokens (Anthropic's API and error shape), POST /v1/score, /score, /v1/rerank,
/rerank, /v2/rerank (yes/no relevance scores), GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version, GET|POST /ping, GET /ready,
GET /openapi.json, GET /docs; with --enable-sleep-mode POST /sleep, POST /wake_up and GET
/is_sleeping.  Every error is OpenAI's JSON error shape; a bad request is
always a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.engine.client import EngineClient
from pagedserve.entrypoints.openai.errors import ApiError, error_body
from pagedserve.entrypoints.openai.http_guard import CorsSettings, install_cors, require_json
from pagedserve.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ReplicaCollector, ServerMetrics
from pagedserve.entrypoints.openai.openapi import install_openapi
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.entrypoints.openai.responses_store import ResponseStore, ResponseStoreConfig
from pagedserve.entrypoints.openai.serving_base import EventStream
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    OpenAIServingEmbedding,
    add_embedding_route,
)
from pagedserve.entrypoints.openai.serving_lora import add_lora_routes, lora_serving
from pagedserve.entrypoints.openai.serving_messages import (
    AnthropicServingMessages,
    add_messages_routes,
    anthropic_error_body,
)
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from pagedserve.entrypoints.openai.serving_score import OpenAIServingScore, add_score_routes
from pagedserve.entrypoints.openai.serving_tokenize import Readiness, add_tokenize_routes
from pagedserve.entrypoints.openai.shutdown import Drain, client_disconnected
from pagedserve.entrypoints.openai.stats_logger import RequestLogger, StatsLogger

__all__ = ["ServerSettings", "build_app"]

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """What the HTTP layer needs besides the engine.

    served_model_names: names accepted in a request's `model` (the first is reported).
    api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>` (or
        Anthropic's `x-api-key: <api_key>`).
    max_body_bytes: larger request bodies are refused with 413.
    chat_template: template text overriding the model's (read from --chat-template).
    metrics_prefix: the name prefix of every Prometheus series (--metrics-prefix).
    cache_info: labels of the ``cache_config_info`` series (block size, blocks, ...).
    stats_interval: seconds between the periodic stats log lines; None: none.
    log_requests: log every request's prompt and parameters (--enable-log-requests),
        cut to ``max_log_len`` characters or token ids.
    """

    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    chat_template: str | None = None
    metrics_prefix: str = "pagedserve"
    cache_info: dict[str, str] | None = None
    stats_interval: float | None = None
    log_requests: bool = False
    max_log_len: int | None = None
    cors: CorsSettings | None = None  # --allowed-origins and friends; None: no CORS headers
    #: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser (a ToolOptions)
    tool_options: object | None = None
    #: --lora-modules as (name, path) pairs and --allow-runtime-lora-updating (docs/lora.md).
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False
    #: --responses-store-* : how many stored /v1/responses are kept, how long, where.
    responses_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    #: --enable-sleep-mode: POST /sleep, POST /wake_up and GET /is_sleeping exist.
    enable_sleep_mode: bool = False


class _ApiKeyMiddleware:
    """Refuses /v1 requests without the right bearer token, before any body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            # Constant-time comparison: response timing must not leak the key.
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.key):  # Anthropic's clients
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(scope):
            message = "Incorrect or missing API key."
            anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
            response = JSONResponse(
                anthropic_error_body(401, message) if anthropic else error_body(message, code="invalid_api_key"),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _EventStreamResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (done, error, client gone)."""

    def __init__(self, stream: EventStream, drain: Drain) -> None:
        name = ",".join(s.request_id for s in stream.streams)
        super().__init__(
            drain.guard(stream.events, name),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without buffering it."""
    too_large = ApiError(
        413,
        f"The request body is larger than the server's limit of {limit} bytes (--max-body-size).",
        code="request_too_large",
    )
    require_json(request)  # before the body: a browser's "simple" cross-site POST is not JSON
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


async def _respond(request: Request, work: Awaitable[dict | EventStream], drain: Drain) -> Response:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away
    or the server's shutdown grace period ends (503)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    cut = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait({task, watcher, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        cut.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        if drain.is_cut:
            raise drain.error()
        return Response(status_code=499)  # nobody is listening; this is for the access log
    result = task.result()
    if isinstance(result, EventStream):
        if watcher.done() and not watcher.cancelled():
            result.abort()
            return Response(status_code=499)
        return _EventStreamResponse(result, drain)
    return JSONResponse(result)


def add_sleep_routes(app: FastAPI, engine: EngineClient) -> None:
    """POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (vLLM's routes and answers):
    the engine frees its weights and KV cache between jobs (docs/memory.md#sleep-mode);
    requests meanwhile get 503 ``engine_sleeping``."""

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        unknown = sorted(set(request.query_params) - {"level"})
        if unknown:
            raise ApiError(
                400, f"unknown query parameter(s) {', '.join(unknown)}; /sleep takes level", param=unknown[0]
            )
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise ApiError(400, f"level must be 1 or 2, got {raw!r}", param="level")
        try:
            await engine.sleep(int(raw))
        except ValueError as e:  # requests in flight (or sleep mode refused by the engine)
            raise ApiError(409, str(e), code="engine_busy") from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        if request.query_params:
            raise ApiError(
                400,
                f"query parameter(s) {', '.join(sorted(request.query_params))} not implemented: /wake_up wakes "
                "the weights and the KV cache together (no tags)",
                param=next(iter(request.query_params)),
            )
        await engine.wake_up()
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": engine.is_sleeping}


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """The ASGI app; starts the engine thread on startup and stops it on shutdown.

    ``engine`` is an `AsyncLLMEngine` or a `DataParallelRouter`: with replicas, /metrics
    adds per-replica series and /health answers with the replicas' state.
    """
    names = settings.served_model_names
    metrics = ServerMetrics(engine.stats, names[0], engine.max_model_len, settings.metrics_prefix, settings.cache_info)
    if engine.replica_status():  # data parallel: per-replica series
        metrics.registry.register(ReplicaCollector(engine.replica_status, names[0]))
    stats_logger = StatsLogger(engine.stats, settings.stats_interval) if settings.stats_interval else None
    request_logger = RequestLogger(settings.max_log_len) if settings.log_requests else None

    def on_output(out) -> None:
        metrics.observe(out)
        if request_logger is not None and out.finished:
            request_logger.finished(out)

    engine.set_callbacks(on_request_output=on_output)
    readiness = Readiness()
    lora = lora_serving(engine, settings.lora_modules, settings.allow_runtime_lora_updating)
    completions = OpenAIServingCompletion(engine, names, settings.chat_template, request_logger, lora)
    chat = OpenAIServingChat(
        engine, names, settings.chat_template, request_logger, lora, tool_options=settings.tool_options
    )
    created = int(time.time())
    drain = Drain()  # cut by the server at the end of its shutdown grace period

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("engine started; serving %s", ", ".join(names))
        await readiness.probe(engine)
        stats_task = asyncio.ensure_future(stats_logger.run()) if stats_logger else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await asyncio.to_thread(engine.shutdown)
            logger.info("engine stopped")

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.drain = drain
    if settings.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=settings.api_key)
    install_cors(app, settings.cors)  # outermost: a preflight carries no API key

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    app.add_exception_handler(ClientDisconnect, client_disconnected)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal_server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        status, body = engine.health()  # data parallel: {"status": "ok" | "degraded" | ..., replicas}
        return Response(status_code=status) if body is None else JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
            "root": names[0],
            "parent": None,
            "max_model_len": engine.max_model_len,
        }

    add_tokenize_routes(
        app,
        engine,
        names,
        settings.chat_template,
        lambda request: read_body(request, settings.max_body_bytes),
        readiness,
    )
    add_embedding_route(
        app,
        OpenAIServingEmbedding(engine, names, settings.chat_template),
        lambda request: read_body(request, settings.max_body_bytes),
        lambda request, work: _respond(request, work, drain),
    )

    @app.get("/v1/models")
    async def list_models() -> dict:
        lora_cards = lora.cards(model_card(names[0]), names[0]) if lora is not None else []
        return {"object": "list", "data": [model_card(n) for n in names] + lora_cards}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if not model:  # "/v1/models/" names no model
            raise ApiError(
                404, "No model id given: use GET /v1/models to list the models.", param="model", code="model_not_found"
            )
        name = completions.model_name(model)
        card = model_card(name)
        return next((c for c in lora.cards(card, names[0]) if c["id"] == name), card) if lora else card

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_body(request, settings.max_body_bytes))
        return await _respond(request, completions.create(body), drain)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_body(request, settings.max_body_bytes))
        return await _respond(request, chat.create(body), drain)

    add_messages_routes(
        app,
        AnthropicServingMessages(chat),
        lambda request: read_body(request, settings.max_body_bytes),
        lambda request, work: _respond(request, work, drain),
    )
    add_responses_routes(
        app,
        OpenAIServingResponses(chat, ResponseStore(settings.responses_store)),
        lambda request: read_body(request, settings.max_body_bytes),
        lambda request, work: _respond(request, work, drain),
    )
    add_score_routes(
        app,
        OpenAIServingScore(engine, names, settings.chat_template, request_logger, lora),
        lambda request: read_body(request, settings.max_body_bytes),
        lambda request, work: _respond(request, work, drain),
    )
    add_lora_routes(app, lora, lambda request: read_body(request, settings.max_body_bytes))
    if settings.enable_sleep_mode:
        add_sleep_routes(app, engine)
    install_openapi(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/embeddings": EmbeddingRequest,
        },
        names,
    )
    return app
