"""AsyncLLMEngine in-process on the tiny model: errors before queueing, continuous
batching across callers, a failing step, the queue bound, a responsive event loop and
shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import SamplingParams
from pagedserve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestFailedError
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama), dtype="float32"),
                                  cache=CacheConfig(kv_cache_memory="16MiB")))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def final(stream):
    out = None
    async for item in stream:
        out = item
    return out


def test_bad_prompt_raises_before_anything_is_queued(engine):
    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        try:
            with pytest.raises(ValueError, match="max_model_len is 1024"):
                await a.add_request("long", [5] * 1024, SamplingParams())
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await a.add_request("vocab", [10**6], SamplingParams())
            assert a._commands.empty() and not engine.has_unfinished_requests()
            out = await final(await a.add_request("ok", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
            assert len(out.outputs[0].token_ids) == 3
        finally:
            await asyncio.to_thread(a.shutdown)

    run(main())


def test_a_new_request_joins_the_running_batch(engine):
    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        try:
            long = await a.add_request("long", [7, 8, 9], LONG)
            first = await long.__anext__()
            assert not first.finished
            short = await a.add_request("short", [3, 4], SamplingParams(temperature=0, max_tokens=4))
            short_done = await final(short)
            long_now = await long.__anext__()
            # The short request finished while the long one was still mid-way.
            assert short_done.finished and not long_now.finished
            assert len(long_now.outputs[0].token_ids) < 400
            long.abort()
        finally:
            await asyncio.to_thread(a.shutdown)
        assert engine.stats().kv_cache_usage == 0

    run(main())


def test_the_engine_thread_survives_a_failing_step(engine, monkeypatch):
    real_execute = engine.runner.execute
    fail = {"armed": False}

    def execute(*args, **kwargs):
        if fail["armed"]:
            fail["armed"] = False
            raise RuntimeError("injected kernel failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    expected = [[5, 6, 7], SamplingParams(temperature=0, max_tokens=8)]

    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        try:
            victim = await a.add_request("victim", [1, 2, 3], LONG)
            await victim.__anext__()
            fail["armed"] = True
            with pytest.raises(RequestFailedError, match="injected kernel failure"):
                await final(victim)
            assert a.is_running and engine.stats().kv_cache_usage == 0
            after = await final(await a.add_request("after", *expected))
            return after.outputs[0].token_ids
        finally:
            await asyncio.to_thread(a.shutdown)

    ids = run(main())
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    ref_id = "ref"
    engine.add_request(ref_id, *expected)
    ref = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ref = out
    assert ids == ref.outputs[0].token_ids


def test_slow_steps_do_not_block_the_event_loop_and_the_queue_is_bounded(engine, monkeypatch):
    real_step = engine.step

    def slow_step():
        time.sleep(0.25)  # a long forward pass (releases the GIL like torch's kernels do)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)

    async def main():
        a = AsyncLLMEngine(engine, max_queue_len=1)
        a.start()
        try:
            running = await a.add_request("a", [1, 2], LONG)
            await running.__anext__()
            waiting = await a.add_request("b", [3, 4], LONG)
            with pytest.raises(QueueFullError):
                await a.add_request("c", [5, 6], LONG)
            # Event-loop lag while steps of 250 ms run: a loop that ran the steps itself
            # would wait a whole step on every sleep.
            lags = []
            for _ in range(20):
                t0 = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t0 - 0.01)
            running.abort()
            waiting.abort()
            return sorted(lags)[len(lags) // 2]
        finally:
            await asyncio.to_thread(a.shutdown)

    assert run(main()) < 0.125


def test_shutdown_fails_open_streams_and_joins_the_thread(engine):
    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        stream = await a.add_request("open", [1, 2], LONG)
        await stream.__anext__()
        await asyncio.to_thread(a.shutdown)
        assert not a._thread.is_alive() and not a.is_running
        with pytest.raises(EngineDeadError):
            await final(stream)
        with pytest.raises(EngineDeadError):
            await a.add_request("late", [1], SamplingParams())

    run(main())
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0
