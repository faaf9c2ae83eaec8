"""Overload: a burst far past what the engine runs at once.  With a queue limit
(``--max-queue-len``) the excess gets a 503 with ``Retry-After`` at once and the rest
finish; without one every request finishes, and memory stays bounded.  No KV block leaks
either way."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

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


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


#: Peak RSS growth (MiB) of this process (server and client) during a 300-request burst,
#: after a warm-up burst.  Measured (docs/serving.md, "Guarantees"): 3-12 MiB.
BURST_RSS_MB = 48


def test_without_a_queue_limit_a_burst_of_300_keeps_memory_bounded(inproc_server):
    _burst(inproc_server.url, 100)  # warm-up: allocator pools, compiled paths, connections
    inproc_server.assert_no_leak()
    base = _rss_mb()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss_mb())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answers = _burst(inproc_server.url, 300)
    finally:
        stop.set()
        sampler.join(5)
    assert all(r.status_code == 200 for r in answers), [r.status_code for r in answers]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in answers)
    inproc_server.assert_no_leak()
    growth = max(peak) - base
    print(f"burst of 300: peak RSS growth {growth:.1f} MiB over {base:.0f} MiB")
    assert growth < BURST_RSS_MB, f"RSS grew {growth:.1f} MiB during the burst"
