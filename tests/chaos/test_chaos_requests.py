"""Chaos in one server: a poisoned request among healthy ones, many concurrent streams
of which a third hang up mid-way, and an abort storm against the engine.  Every
surviving request is answered exactly as if it had run alone (greedy), every failed one
gets an error, nothing hangs and no KV block leaks."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from chaos_helpers import read_stream, run, solo_texts

from pagedserve import SamplingParams
from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.loader.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.timeout(600)

POISON = [7, 7, 7, 7]  # prompts starting with these fail in their detokenizer


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(20)]  # some share a prefix: prefix-cache hits
    return [
        (shared if i % 3 == 0 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))] for i in range(n)
    ]


def test_a_poisoned_request_fails_alone(inproc_server, offline, monkeypatch):
    real_step = IncrementalDetokenizer.step

    def step(self, new_token_ids):
        if self.token_ids[:4] == POISON and len(self.output_token_ids) >= 2:
            raise ValueError("injected: this request's tokens cannot be decoded")
        return real_step(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    prompts = prompts_for(6, seed=1)
    refs = solo_texts(offline, prompts, 24)

    async def main():
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=120) as c:
            good = [
                read_stream(c, {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for p in prompts
            ]
            bad_stream = read_stream(c, {"prompt": POISON + [9], "max_tokens": 40, "n": 3, "temperature": 0})
            bad_whole = c.post("/v1/completions", json={"prompt": POISON + [8], "max_tokens": 40})
            return await asyncio.gather(asyncio.gather(*good), bad_stream, bad_whole)

    good, bad_stream, bad_whole = run(main())
    assert [g["text"] for g in good] == refs
    assert all(g["finish_reason"] == "length" and g["done"] and not g["errors"] for g in good)
    assert bad_stream["done"] and bad_stream["finish_reason"] is None
    assert len(bad_stream["errors"]) == 1 and "cannot be decoded" in bad_stream["errors"][0]["message"]
    assert bad_whole.status_code == 500 and "cannot be decoded" in bad_whole.json()["error"]["message"]
    assert httpx.get(inproc_server.url + "/health").status_code == 200
    inproc_server.assert_no_leak()


def _disconnect_run(inproc_server, offline, num_streams: int) -> None:
    rng = random.Random(num_streams)
    prompts = prompts_for(num_streams, seed=2)
    lengths = [rng.randrange(4, 20) for _ in prompts]
    quitters = set(rng.sample(range(num_streams), k=round(0.3 * num_streams)))

    async def main():
        limits = httpx.Limits(max_connections=num_streams + 8)
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(
                *[
                    read_stream(
                        c,
                        {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True},
                        stop_after=rng.randrange(1, 4) if i in quitters else None,
                    )
                    for i, (p, m) in enumerate(zip(prompts, lengths))
                ]
            )

    results = run(main(), timeout=900)
    kept = [i for i in range(num_streams) if i not in quitters]
    refs = {
        i: offline.generate(
            [prompts[i]], SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
        for i in kept
    }
    for i in kept:
        r = results[i]
        assert r["done"] and not r["errors"] and r["finish_reason"] == "length", (i, r)
        assert r["text"] == refs[i], i
    assert all(results[i]["cut"] or results[i]["done"] for i in quitters)
    inproc_server.assert_no_leak()
    r = httpx.post(inproc_server.url + "/v1/completions", json={"prompt": "again", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_concurrent_streams_with_disconnects(inproc_server, offline):
    _disconnect_run(inproc_server, offline, 24)


@pytest.mark.slow
def test_128_concurrent_streams_with_disconnects(inproc_server, offline):
    _disconnect_run(inproc_server, offline, 128)


def _abort_storm(llm_engine, num_requests: int, seed: int) -> None:
    """Requests (some n > 1, many sharing prefixes) aborted at random moments: before
    they are accepted, while queued, mid-generation, after they finished, twice."""
    rng = random.Random(seed)
    prompts = prompts_for(num_requests, seed=seed)

    async def one(a: AsyncLLMEngine, i: int):
        params = SamplingParams(
            temperature=rng.choice([0, 0.8]),
            max_tokens=rng.randrange(1, 30),
            n=rng.choice([1, 1, 2, 3]),
            seed=i,
            ignore_eos=True,
        )
        when = rng.choice(["never", "at-once", "after-accept", "mid", "after-finish"])
        task = asyncio.ensure_future(a.add_request(f"r{i}", prompts[i], params))
        if when == "at-once":
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
            task.result().abort()
            return "aborted"
        stream = await task
        if when == "after-accept":
            stream.abort()
            return "aborted"
        seen = 0
        async for _out in stream:
            seen += 1
            if when == "mid" and seen >= rng.randrange(1, 4):
                stream.abort()
                stream.abort()
                return "aborted"
        if when == "after-finish":
            stream.abort()
            a.abort(f"r{i}")
        return "finished"

    async def main():
        a = AsyncLLMEngine(llm_engine)
        a.start()
        try:
            return await asyncio.gather(*[one(a, i) for i in range(num_requests)], return_exceptions=True)
        finally:
            await asyncio.to_thread(a.shutdown)

    results = run(main(), timeout=600)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert "finished" in results and "aborted" in results
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.kv.usage() == 0
    llm_engine.kv.pool.check_invariants()


def test_abort_storm_leaks_no_block(inproc_server):
    inproc_server.stop()  # the storm drives the engine directly
    _abort_storm(inproc_server.engine, 60, seed=3)


@pytest.mark.slow
def test_abort_storm_leaks_no_block_long(inproc_server):
    inproc_server.stop()
    for seed in range(5):
        _abort_storm(inproc_server.engine, 300, seed=seed)


def test_an_engine_wide_failure_fails_every_stream_and_turns_health_red(inproc_server, monkeypatch):
    runner = inproc_server.engine.runner
    real_execute = runner.execute
    armed = {"on": False}

    def execute(*args, **kwargs):
        if armed["on"]:
            raise RuntimeError("injected device failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    dead: list[BaseException] = []
    inproc_server.async_engine.on_engine_dead = dead.append

    async def main():
        async with httpx.AsyncClient(base_url=inproc_server.url, timeout=120) as c:
            body = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
            tasks = [asyncio.ensure_future(read_stream(c, {**body, "prompt": [5 + i, 6]})) for i in range(4)]
            while inproc_server.engine.stats().num_running < 4:
                await asyncio.sleep(0.01)
            armed["on"] = True
            return await asyncio.gather(*tasks)

    results = run(main())
    for r in results:
        assert r["done"] and r["finish_reason"] is None, r
        assert len(r["errors"]) == 1 and "injected device failure" in r["errors"][0]["message"]
    assert httpx.get(inproc_server.url + "/health").status_code == 503
    after = httpx.post(inproc_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_unavailable"
    assert len(dead) == 1 and "injected device failure" in str(dead[0])
    inproc_server.assert_no_leak()
