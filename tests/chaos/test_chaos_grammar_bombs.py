"""Grammar bombs against a running server: each bomb class gets a 400 naming the field
and the setting within a bounded time, a compile that hangs fails its request at the
deadline, and plain requests sent meanwhile stay within a generous factor of their
latency alone (no absolute speed is asserted, only timeouts)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
from chaos_helpers import run

pytestmark = pytest.mark.timeout(300)

PLAIN = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _tree(depth: int) -> dict:
    if depth == 0:
        return {"type": "string"}
    return {"type": "object", "properties": {"a": _tree(depth - 1), "b": _tree(depth - 1)}}


BOMBS = {
    "16k-leaf schema": {"json": _tree(14)},
    "200,000-string enum": {"json": {"enum": [f"s{i}" for i in range(200_000)]}},
    "(x{1000}){1000}": {"regex": "(x{1000}){1000}"},
    "minItems 10,000,000": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}},
    "20,000 rules": {"grammar": "\n".join(f'r{i} ::= "a"' for i in range(20_000)) + "\nroot ::= r0"},
    "nested pattern": {"json": {"type": "string", "pattern": "^([a-z]{1,1000}){1,1000}$"}},
}


async def _timed(client: httpx.AsyncClient, body: dict | bytes) -> tuple[float, httpx.Response]:
    # Big bodies come encoded: encoding a megabyte of JSON would stall this test's own loop.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    return time.monotonic() - t0, r


async def _plain_latencies(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        dt, r = await _timed(client, PLAIN)
        assert r.status_code == 200, r.text
        out.append(dt)
    return out


def _alone(client_url: str) -> float:
    async def main():
        async with httpx.AsyncClient(base_url=client_url, timeout=60) as c:
            await _timed(c, PLAIN)  # warm-up
            return max([(await _timed(c, PLAIN))[0] for _ in range(3)])

    return run(main())


def test_grammar_bombs_get_a_fast_400_and_plain_requests_go_on(inproc_server):
    alone = _alone(inproc_server.url)
    bodies = {name: json.dumps({**PLAIN, "structured_outputs": so}).encode() for name, so in BOMBS.items()}

    async def main():
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=60) as c:
            stop = asyncio.Event()
            plain = asyncio.ensure_future(_plain_latencies(c, stop))
            answers = {}
            for name, body in bodies.items():
                dt, r = await _timed(c, body)
                answers[name] = (dt, r.status_code, r.json()["error"])
            stop.set()
            return answers, await plain

    answers, latencies = run(main())
    print(f"plain alone {alone:.3f} s; during bombs max {max(latencies):.3f} s over {len(latencies)} requests")
    print({name: f"{dt:.3f} s" for name, (dt, _, _) in answers.items()})
    for name, (dt, status, error) in answers.items():
        assert status == 400, (name, error)
        assert "max_grammar_" in error["message"] and error["param"] == "structured_outputs", (name, error)
        assert dt < 30, (name, dt)  # a deadline: without the limits these took minutes
    # Generous: a megabyte body is still read and parsed by this process's server thread
    # (which shares the GIL with this test); before the limits plain requests took 6 s
    # and the bombs got no answer within 60 s.
    assert latencies and max(latencies) < 20 * alone + 5.0, (alone, latencies)
    inproc_server.assert_no_leak()


class _HangingBackend:
    def __init__(self) -> None:
        self.release = threading.Event()

    def compile(self, grammar):
        self.release.wait(120)
        raise RuntimeError("released")


def test_a_hanging_compile_gets_an_error_at_the_deadline(inproc_server):
    warm = httpx.post(
        inproc_server.url + "/v1/completions", json={**PLAIN, "structured_outputs": {"choice": ["a"]}}, timeout=120
    )
    assert warm.status_code == 200, warm.text  # the constrained path's first use (its kernels) out of the way
    mgr = inproc_server.engine.structured
    backend = _HangingBackend()
    mgr._backend, mgr.compile_timeout = backend, 1.0  # a compile that never ends, a short deadline
    alone = _alone(inproc_server.url)
    body = {**PLAIN, "structured_outputs": {"choice": ["never"]}}

    async def main():
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=60) as c:
            stop = asyncio.Event()
            plain = asyncio.ensure_future(_plain_latencies(c, stop))
            first = await _timed(c, body)
            again = await _timed(c, body)
            stop.set()
            return first, again, await plain

    try:
        (dt, r), (dt_again, r_again), latencies = run(main())
    finally:
        backend.release.set()
    print(
        f"deadline 1 s: error after {dt:.3f} s, again {dt_again:.3f} s; "
        f"plain alone {alone:.3f} s, max {max(latencies):.3f} s"
    )
    assert r.status_code == 400 and "grammar_compile_timeout" in r.json()["error"]["message"], r.text
    assert dt < 30, dt
    # The same constraint is refused when it arrives, without waiting for another deadline.
    assert r_again.status_code == 400 and "grammar_compile_timeout" in r_again.json()["error"]["message"]
    assert dt_again < dt
    assert latencies and max(latencies) < 20 * alone + 2.0, (alone, latencies)
    inproc_server.assert_no_leak()


def _thread_cpu_s(native_id: int) -> float:
    # utime + stime of one thread, in clock ticks (fields 14 and 15 of /proc/.../stat).
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_engine_thread_does_not_spin_while_a_grammar_compiles(inproc_server):
    mgr = inproc_server.engine.structured
    backend = _HangingBackend()
    mgr._backend, mgr.compile_timeout = backend, 0  # a compile that does not end, no deadline
    tid = inproc_server.async_engine._thread.native_id

    async def main():
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=60) as c:
            waiting = asyncio.ensure_future(_timed(c, {**PLAIN, "structured_outputs": {"choice": ["never"]}}))
            while inproc_server.engine.stats().num_waiting == 0:
                await asyncio.sleep(0.01)
            cpu0, t0 = _thread_cpu_s(tid), time.monotonic()
            await asyncio.sleep(1.5)
            used = (_thread_cpu_s(tid) - cpu0) / (time.monotonic() - t0)
            waiting.cancel()
            return used

    try:
        used = run(main())
    finally:
        backend.release.set()
    # Spinning on an empty schedule took a whole core; waiting costs next to nothing.
    assert used < 0.25, f"the engine thread used {used:.0%} of a core while nothing could run"
