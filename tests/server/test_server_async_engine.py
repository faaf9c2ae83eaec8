"""AsyncLLMEngine in-process on the tiny model: errors before queueing, continuous
batching across callers, a failing step, the queue bound, a responsive event loop and
shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import SamplingParams
from pagedserve.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, QueueFullError, RequestFailedError
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_llama), dtype="float32"), cache=CacheConfig(kv_cache_memory="16MiB")
        )
    )


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


def test_a_request_that_fails_on_its_own_fails_alone(engine, monkeypatch):
    """A failure in one request's post-processing (here its detokenizer) fails that
    request with RequestFailedError; its neighbour's greedy answer is unchanged."""
    from pagedserve.loader.detokenizer import IncrementalDetokenizer

    real_step = IncrementalDetokenizer.step

    def step(self, new_token_ids):
        if self.token_ids[:3] == [9, 9, 9] and len(self.output_token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected bad byte")
        return real_step(self, new_token_ids)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("solo", [5, 6, 7], params)
    solo = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            solo = out
    monkeypatch.setattr(IncrementalDetokenizer, "step", step)

    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        try:
            good = await a.add_request("good", [5, 6, 7], params)
            bad = await a.add_request("bad", [9, 9, 9], SamplingParams(temperature=0, max_tokens=50, n=2))
            with pytest.raises(RequestFailedError, match="injected bad byte"):
                await final(bad)
            out = await final(good)
            assert a.is_running
            return out
        finally:
            await asyncio.to_thread(a.shutdown)

    out = run(main())
    assert out.outputs[0].token_ids == solo.outputs[0].token_ids
    assert out.outputs[0].text == solo.outputs[0].text
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0


def test_a_failing_step_stops_the_engine_loudly(engine, monkeypatch):
    """An exception out of step() is engine-wide: every request fails with
    EngineDeadError, the engine reports itself dead and calls on_engine_dead."""
    real_execute = engine.runner.execute
    fail = {"armed": False}

    def execute(*args, **kwargs):
        if fail["armed"]:
            raise RuntimeError("injected kernel failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)

    async def main():
        a = AsyncLLMEngine(engine)
        dead: list[BaseException] = []
        a.on_engine_dead = dead.append
        a.start()
        victims = [await a.add_request(f"v{i}", [1, 2, 3 + i], LONG) for i in range(3)]
        for v in victims:
            await v.__anext__()
        fail["armed"] = True
        for v in victims:
            with pytest.raises(EngineDeadError, match="injected kernel failure"):
                await final(v)
        await asyncio.sleep(0.05)  # on_engine_dead is posted to the loop after the streams
        assert not a.is_running and isinstance(a.fatal_error, EngineStepError)
        assert dead == [a.fatal_error]
        with pytest.raises(EngineDeadError):
            await a.add_request("late", [1], SamplingParams())
        await asyncio.to_thread(a.shutdown)

    run(main())
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0


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
