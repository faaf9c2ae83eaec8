"""Data-parallel replicas as Ray actors (--data-parallel-backend ray) on a local Ray head:
the router's answers equal one engine's, and a killed actor fails its request clearly
while the other replica keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.async_engine import RequestFailedError
from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from pagedserve.serving.data_parallel import DataParallelConfig

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")

pytestmark = pytest.mark.timeout(180)


async def _text(router, rid: str, prompt, max_tokens: int) -> str:
    stream = await router.add_request(
        rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    last = None
    async for out in stream:
        last = out
    return last.outputs[0].text


def test_ray_replicas_serve_and_a_killed_actor_is_reported(tiny_llama):
    from pagedserve.serving.router import DataParallelRouter

    prompts = ["Hello world", "The quick brown fox", [5, 6, 7, 8], "Once upon"]
    offline = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", threads=1)
    expected = [
        o.outputs[0].text
        for o in offline.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    ]
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama), dtype="float32"),
        cache=CacheConfig(kv_cache_memory="64MiB"),
        device=DeviceConfig(threads=2),
    )
    ray.init(
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False
    )
    router = None
    try:
        router = DataParallelRouter(config, DataParallelConfig(size=2, backend="ray"))

        async def main() -> None:
            router.start()
            texts = await asyncio.gather(*[_text(router, f"r{i}", p, 8) for i, p in enumerate(prompts)])
            assert list(texts) == expected
            assert [s.routed for s in router.replica_status()] == [2, 2]
            long = asyncio.ensure_future(_text(router, "long", list(range(3, 40)), 900))
            while not any(s.stats.num_running for s in router.replica_status()):
                await asyncio.sleep(0.05)
            victim = next(s.index for s in router.replica_status() if s.stats.num_running)
            ray.kill(router._launcher.actors[victim])
            with pytest.raises(RequestFailedError, match=f"data-parallel replica {victim} .*Ray actor"):
                await asyncio.wait_for(long, 60)
            assert [s.alive for s in router.replica_status()].count(True) == 1
            assert await _text(router, "after", prompts[0], 8) == expected[0]

        asyncio.run(main())
    finally:
        if router is not None:
            router.shutdown()
        ray.shutdown()
