"""PAGEDSERVE_STEP_TRACE: one JSON line per engine step and per hand-over of a step's
outputs to the event loop (core/engine/step_trace.py), off when the variable is unset."""

from __future__ import annotations

import asyncio
import json

from pagedserve import SamplingParams
from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine import LLMEngine
from pagedserve.engine.step_trace import ENV_VAR


def make_engine(tiny_llama) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_llama), dtype="float32"),
            cache=CacheConfig(kv_cache_memory="16MiB"),
            # 16-token prompt chunks: the long prompt is computed beside the short one's decodes.
            scheduler=SchedulerConfig(long_prefill_token_threshold=16, max_prefill_tokens_with_decodes=16),
        )
    )


def test_off_unless_the_variable_is_set(tiny_llama, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert make_engine(tiny_llama).step_trace is None


def test_steps_and_hand_overs_account_for_every_token(tiny_llama, monkeypatch, tmp_path):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    engine = make_engine(tiny_llama)
    prompts = {"short": list(range(10, 15)), "long": list(range(20, 90))}
    max_tokens = {"short": 12, "long": 5}

    async def main():
        a = AsyncLLMEngine(engine)
        a.start()
        try:
            short = await a.add_request("short", prompts["short"], SamplingParams(max_tokens=12, ignore_eos=True))
            await short.__anext__()  # decoding before the long prompt arrives
            long = await a.add_request("long", prompts["long"], SamplingParams(max_tokens=5, ignore_eos=True))
            for stream in (short, long):
                async for _ in stream:
                    pass
        finally:
            await asyncio.to_thread(a.shutdown)

    asyncio.run(asyncio.wait_for(main(), 300))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if r["ev"] == "step"]
    dispatches = [r for r in records if r["ev"] == "dispatch"]
    for rid, prompt in prompts.items():
        assert sum(s["prefill"].get(rid, 0) for s in steps) == len(prompt)
        assert sum(rid in s["first"] for s in steps) == 1
        assert sum(rid in s["decode"] for s in steps) == max_tokens[rid] - 1
    # The long prompt went in 16-token chunks beside the short request's decodes.
    assert any("short" in s["decode"] and s["prefill"].get("long") == 16 for s in steps)
    for s in steps:
        assert s["t0"] <= s["t_sched"] <= s["t_fwd"] <= s["t_end"]
    for d in dispatches:
        assert d["t_post"] <= d["t_loop"] <= d["t_done"]
    # Every step's outputs reached the event loop, in order.
    with_outputs = [s for s in steps if s["outputs"]]
    handed = [d for d in dispatches if d["outputs"]]
    assert [s["outputs"] for s in with_outputs] == [d["outputs"] for d in handed]
    assert all(s["t_end"] <= d["t_post"] for s, d in zip(with_outputs, handed))
