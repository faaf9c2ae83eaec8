"""Ending in-flight requests cleanly at shutdown, and quiet logs for clients that leave.

On SIGTERM uvicorn stops accepting connections and waits up to the grace period
(`--timeout-graceful-shutdown`) for open requests; after that it cancels their tasks, so
a stream would stop mid-way with neither a `finish_reason` nor an error, and every cut
stream would log a CancelledError traceback.  Instead, `Drain.cut()` fires at the end of
the grace period (`GracefulServer`): each open stream then sends an SSE error event
(`code: "server_shutdown"`) and `[DONE]` and closes, and a non-streamed request still
waiting gets a 503 in OpenAI's error shape.  uvicorn's own deadline comes a little later
as the last resort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from pagedserve.entrypoints.openai.errors import ApiError, error_body
from pagedserve.entrypoints.openai.serving_base import SSE_DONE, sse

__all__ = ["Drain", "GracefulServer", "SHUTDOWN_MESSAGE", "client_disconnected", "CUT_MARGIN_S"]

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "The server is shutting down; this request was cut before it finished."
CUT_MARGIN_S = 3.0  # between our cut and uvicorn's forced cancellation


class Drain:
    """The moment in-flight requests are cut: set once, at the end of the grace period."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    @property
    def is_cut(self) -> bool:
        return self._event.is_set()

    def cut(self) -> None:
        if not self._event.is_set():
            logger.info("grace period over: cutting the requests still open")
            self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def error(self) -> ApiError:
        return ApiError(503, SHUTDOWN_MESSAGE, code="server_shutdown")

    async def guard(self, events: AsyncIterator[str], request_id: str = "") -> AsyncIterator[str]:
        """SSE lines of `events` until they end or the drain is cut; a cut stream ends with
        an error event and `[DONE]`."""
        it = events.__aiter__()
        cut = asyncio.ensure_future(self._event.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait({nxt, cut}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    try:
                        line = nxt.result()
                    except StopAsyncIteration:
                        return
                    yield line
                    continue
                logger.info("stream %s cut at shutdown", request_id or "(unnamed)")
                yield sse(error_body(SHUTDOWN_MESSAGE, "service_unavailable", code="server_shutdown"))
                yield SSE_DONE
                return
        finally:
            # However the response ends (done, cut, client gone), the pending read must not
            # outlive it: cancelling it runs the inner generator's own cleanup.
            cut.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


async def client_disconnected(request: Request, exc: ClientDisconnect) -> Response:
    """Exception handler: a client that hung up while sending its body is routine, not an error."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "client"
    logger.info("%s disconnected while sending %s %s", client, request.method, request.url.path)
    return Response(status_code=499)  # nobody reads it; this is for the access log


class GracefulServer(uvicorn.Server):
    """uvicorn's server with our cut `grace_s` seconds into its shutdown.

    `config.timeout_graceful_shutdown` should be `grace_s + CUT_MARGIN_S`.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.drain.cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
