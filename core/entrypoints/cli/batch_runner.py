"""Requests of an OpenAI batch file answered by the server's own app, in process.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with url
/v1/chat/completions, /v1/completions or /v1/embeddings (and /v1/responses).  Each line is
sent to the ASGI app of `pagedserve serve` (no socket), so an answer equals the
server's, and a bad request is the server's 4xx.  Output lines, in input order:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``;
``error`` is null for a 2xx answer, else ``{"code", "message"}``, and a line that is not
a request at all has ``response: null``.  A bad line never stops the file.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import httpx

__all__ = ["BATCH_URLS", "run_batch", "Progress"]

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class Progress:
    """tqdm's bar when tqdm is installed, else a plain counter on stderr."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc="run-batch", unit="req", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            end = "\n" if self.done == self.total else ""
            print(f"\rrun-batch: {self.done}/{self.total} requests", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _line_error(custom_id: Any, code: str, message: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def _parse(line: str, index: int, seen: set[str]) -> tuple[dict | None, dict | None]:
    """(request, None) for a good line, (None, output line) for a bad one."""
    where = f"line {index + 1}"
    try:
        req = json.loads(line)
    except ValueError as e:
        return None, _line_error(None, "invalid_json", f"{where} is not JSON: {e}")
    if not isinstance(req, dict):
        return None, _line_error(None, "invalid_request", f"{where} must be a JSON object")
    custom_id = req.get("custom_id")
    problem = None
    if not isinstance(custom_id, str) or not custom_id:
        problem = "'custom_id' must be a non-empty string"
    elif custom_id in seen:
        problem = f"'custom_id' {custom_id!r} was used by an earlier line"
    elif req.get("method", "POST") != "POST":
        problem = f"'method' must be POST, got {req.get('method')!r}"
    elif req.get("url") not in BATCH_URLS:
        problem = f"'url' must be one of {', '.join(BATCH_URLS)}; got {req.get('url')!r}"
    elif not isinstance(req.get("body"), dict):
        problem = "'body' must be a JSON object"
    elif req["body"].get("stream"):
        problem = "'body.stream' must be false in a batch file"
    if problem:
        return None, _line_error(
            custom_id if isinstance(custom_id, str) else None, "invalid_request", f"{where}: {problem}"
        )
    seen.add(custom_id)
    return req, None


async def _send(client: httpx.AsyncClient, req: dict) -> dict:
    request_id = f"batch-{uuid.uuid4().hex}"
    resp = await client.post(req["url"], json=req["body"], headers={"X-Request-Id": request_id})
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text, "type": "internal_server_error", "param": None, "code": None}}
    error = None
    if resp.status_code >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("code") or err.get("type") or str(resp.status_code), "message": err.get("message")}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": req["custom_id"],
        "response": {"status_code": resp.status_code, "request_id": request_id, "body": body},
        "error": error,
    }


async def run_batch(
    app: Any,
    lines: Iterable[str],
    write: Callable[[dict], None],
    max_concurrency: int = 256,
    progress: bool = True,
) -> tuple[int, int]:
    """Answer every line with ``app`` (its lifespan already entered); ``write`` gets the
    output objects in input order.  Returns (succeeded, failed)."""
    numbered = [(i, line) for i, line in enumerate(lines) if line.strip()]
    bar = Progress(len(numbered), progress)
    seen: set[str] = set()
    parsed = [_parse(line, i, seen) for i, line in numbered]  # in order: a repeated custom_id is the later line's fault
    gate = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    counts = [0, 0]

    async def one(client: httpx.AsyncClient, req: dict | None, out: dict | None) -> dict:
        if req is not None:
            async with gate:
                try:
                    out = await _send(client, req)
                except Exception as e:  # noqa: BLE001 - one line's failure is reported on that line
                    out = _line_error(req["custom_id"], "internal_error", f"{type(e).__name__}: {e}")
        bar.update()
        return out

    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            tasks = [asyncio.ensure_future(one(client, req, out)) for req, out in parsed]
            for task in tasks:  # in input order, each written as soon as it and those before it are done
                out = await task
                counts[out["error"] is not None] += 1
                write(out)
    finally:
        bar.close()
    return counts[0], counts[1]
