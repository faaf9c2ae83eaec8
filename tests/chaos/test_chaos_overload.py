"""Overload: a burst far past what the engine runs at once.  With a queue limit
(``--max-queue-len``) the excess gets a 503 with ``Retry-After`` at once and the rest
finish; without one every request finishes.  No KV block leaks either way."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from chaos_helpers import run

pytestmark = pytest.mark.timeout(300)

BODY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def _burst(url: str, n: int) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(
                *(c.post("/v1/completions", json={**BODY, "prompt": [5 + i % 200, 6]}) for i in range(n))
            )

    return run(main())


def test_a_burst_past_the_queue_limit_gets_503_with_retry_after(inproc_server):
    inproc_server.async_engine.max_queue_len = 4
    answers = _burst(inproc_server.url, 60)
    refused = [r for r in answers if r.status_code == 503]
    served = [r for r in answers if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == len(answers), [r.status_code for r in answers]
    for r in refused:
        assert r.headers.get("Retry-After") and r.json()["error"]["code"] == "queue_full", r.text
    for r in served:
        assert r.json()["choices"][0]["finish_reason"] == "length"
    inproc_server.assert_no_leak()


def test_without_a_queue_limit_every_request_of_a_burst_finishes(inproc_server):
    answers = _burst(inproc_server.url, 60)
    assert all(r.status_code == 200 for r in answers), [r.status_code for r in answers]
    inproc_server.assert_no_leak()
