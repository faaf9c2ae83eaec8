"""Sleep mode: LLM.sleep(level) / wake_up() free the weights and the KV cache and bring
them back with identical outputs (greedy tokens and logprobs); requests are refused while
asleep; what cannot sleep is refused by the configuration rules."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, LoRAConfig, ModelConfig
from pagedserve.engine.llm_engine import EngineSleepingError

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, enable_sleep_mode=True)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 259) for _ in range(13)]
    out = [[rng.randrange(3, 259) for _ in range(n)] for n in (3, 11, 25)]
    return out + [shared + [rng.randrange(3, 259) for _ in range(n)] for n in (2, 7)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def run(llm: LLM, ps) -> list[tuple[list[int], list[dict]]]:
    outs = llm.generate(ps, PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for pa, pb in zip(la, lb, strict=True):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert pb[tok].logprob == pytest.approx(pa[tok].logprob, abs=1e-5)


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.llm_engine.kv
    kv.pool.check_invariants()
    assert kv.num_blocks_in_use == 0


@pytest.mark.compat("sleep_mode", "single")
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_same_outputs_and_memory_freed(tiny_llama, level):
    llm = LLM(str(tiny_llama), **ENGINE)
    ps = prompts()
    before = run(llm, ps)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    num_blocks = runner.num_blocks
    # Weak references: sleeping must drop the last reference to the weights and the KV cache.
    weights = weakref.ref(runner.model.embed)
    key_cache = weakref.ref(runner.kv_caches[0][0])
    assert engine.kv.pool.cached  # the prompts' full blocks are cached
    llm.sleep(level)
    gc.collect()
    assert llm.is_sleeping() and weights() is None and key_cache() is None
    assert runner.model is None and runner.kv_caches == []
    assert not engine.kv.pool.cached  # the prefix cache went with the KV cache
    if level == 1:
        assert runner._host_weights  # the host copy it wakes from
    else:
        assert runner._host_weights is None
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate(ps, PARAMS, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # nothing queued by the refused call
    llm.sleep(level)  # sleeping again does nothing
    llm.wake_up()
    assert not llm.is_sleeping() and runner.num_blocks == num_blocks
    assert runner._host_weights is None
    assert_same(before, run(llm, ps))
    assert_no_leaks(llm)
    llm.wake_up()  # waking an engine that is awake does nothing
    assert_same(before, run(llm, ps))  # now with prefix-cache hits
    assert_no_leaks(llm)


@pytest.mark.compat("sleep_mode", "kv_offload")
@pytest.mark.compat("sleep_mode", "device_map")
def test_sleep_with_host_tier_and_device_map(tiny_checkpoint_factory):
    """The host KV tier keeps its blocks across sleep (host memory): after waking, prefix
    hits are reloaded from it; a device map's segments are rebuilt in place."""
    path = tiny_checkpoint_factory(num_layers=4)
    ref = LLM(str(path), **{**ENGINE, "enable_sleep_mode": False})
    ps = prompts(1)
    expected = run(ref, ps)
    small = {**ENGINE, "kv_cache_memory": "96KiB", "max_model_len": 64}  # 24 blocks: prefixes spill
    llm = LLM(str(path), **small, kv_offload_memory="1MiB", device_map="cpu:2,cpu")
    assert_same(expected, run(llm, ps))
    llm.sleep(1)
    llm.wake_up()
    kv = llm.llm_engine.kv
    reloaded = kv.num_reloaded_tokens
    assert_same(expected, run(llm, ps))
    assert kv.num_reloaded_tokens > reloaded  # prefixes that spilled before the sleep
    kv.check_invariants()
    llm.sleep(2)
    llm.wake_up()
    assert_same(expected, run(llm, ps))
    kv.check_invariants()


def test_sleep_refusals(tiny_llama):
    llm = LLM(str(tiny_llama), **{**ENGINE, "enable_sleep_mode": False})
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    llm = LLM(str(tiny_llama), **ENGINE)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level)
    engine = llm.llm_engine
    engine.add_request("busy", None, SamplingParams(max_tokens=4), prompt_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="1 request.*in flight"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    engine.abort_request("busy")
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights"])
    llm.sleep(2)
    with pytest.raises(EngineSleepingError):
        engine.export_prefix_kv([5, 6, 7, 8, 9])
    llm.wake_up()


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"lora": LoRAConfig(enable_lora=True)}, "enable_lora"),
    ],
)
def test_sleep_mode_config_rules(kwargs, names):
    with pytest.raises(ValueError, match=f"enable_sleep_mode cannot be combined with {names}"):
        EngineConfig(model=ModelConfig(enable_sleep_mode=True), **kwargs)


def test_sleep_mode_rules_offload_and_data_parallel():
    from pagedserve.config import CacheConfig
    from pagedserve.config_rules import check_data_parallel

    with pytest.raises(ValueError, match="enable_sleep_mode cannot be combined with cpu_offload_gb"):
        EngineConfig(model=ModelConfig(enable_sleep_mode=True), cache=CacheConfig(cpu_offload_gb=1.0))
    with pytest.raises(ValueError, match="enable_sleep_mode cannot be combined with data_parallel_size=2"):
        check_data_parallel(EngineConfig(model=ModelConfig(enable_sleep_mode=True)), 2)
