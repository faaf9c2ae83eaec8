"""The KV block size: the user's when set, else the platform's default (resolved before
the cache is sized), and where the resolved value shows (config, runner, KV manager,
`pagedserve platforms`, the planner)."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig, EngineConfig
from pagedserve.config_rules import RECURRENT_STATE, RECURRENT_STATE_BLOCK_SIZE, resolve_block_size
from pagedserve.platforms import Platform
from pagedserve.platforms.cpu.platform import CpuPlatform

pytestmark = pytest.mark.timeout(300)


def test_each_platform_has_a_default_block_size():
    assert Platform.default_block_size == 16
    cpu = CpuPlatform.default_block_size
    assert cpu >= 16 and cpu & (cpu - 1) == 0
    assert CpuPlatform().describe()["default_block_size"] == cpu


def test_unset_block_size_takes_the_platform_default_and_a_set_one_wins():
    unset = EngineConfig()
    assert unset.cache.block_size is None
    resolved, how = resolve_block_size(unset, [64])
    assert resolved.cache.block_size == 64 and "default" in how
    assert unset.cache.block_size is None  # the caller's config is left as it is
    assert resolved.cache.kv_connector_memory == unset.cache.kv_connector_memory

    mine = EngineConfig(cache=CacheConfig(block_size=8))
    same, how = resolve_block_size(mine, [64])
    assert same is mine and same.cache.block_size == 8 and "set" in how
    # A model with recurrent-state layers keeps the user's block size too.
    assert resolve_block_size(mine, [64], [None, RECURRENT_STATE])[0].cache.block_size == 8


def test_several_platforms_take_the_smallest_default_and_recurrent_models_keep_16():
    assert resolve_block_size(EngineConfig(), [64, 16, 32])[0].cache.block_size == 16
    resolved, how = resolve_block_size(EngineConfig(), [64], [None, RECURRENT_STATE, None])
    assert resolved.cache.block_size == RECURRENT_STATE_BLOCK_SIZE == 16
    assert "recurrent" in how
    # A platform asking for blocks smaller than 16 keeps them for such a model.
    assert resolve_block_size(EngineConfig(), [8], [RECURRENT_STATE])[0].cache.block_size == 8
    # Sliding windows alone do not change the default.
    assert resolve_block_size(EngineConfig(), [64], [None, 32])[0].cache.block_size == 64


@pytest.mark.parametrize("bad", [[], [48], [0]])
def test_a_default_that_is_no_power_of_two_is_refused(bad):
    with pytest.raises(ValueError):
        resolve_block_size(EngineConfig(), bad)


def test_a_block_size_that_is_no_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=24)


def test_the_engine_runs_with_the_platform_default_unless_told_otherwise(tiny_llama, caplog, monkeypatch):
    # A default other than 16 (whatever the CPU's is), so that the user's 16 is told apart.
    default = 32
    monkeypatch.setattr(CpuPlatform, "default_block_size", default)
    prompt = list(range(5, 5 + default + 9))  # past one default block: a block boundary inside the prompt
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = {}
    for block_size in (None, 16):
        kwargs = {} if block_size is None else {"block_size": block_size}
        with caplog.at_level("INFO", logger="pagedserve.engine.llm_engine"):
            llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory="8MiB", **kwargs)
        try:
            engine = llm.llm_engine
            want = default if block_size is None else block_size
            assert engine.config.cache.block_size == want
            assert engine.runner.block_size == want and engine.kv.block_size == want
            assert engine.runner.kv_caches[0][0].shape[1] == want
            assert f"KV cache blocks of {want} tokens" in caplog.text
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            # The second run hits the prefix cache in whole blocks of the resolved size.
            assert again.num_cached_tokens == (len(prompt) - 1) // want * want
            outs[block_size] = out
        finally:
            llm.shutdown()
        caplog.clear()
    assert outs[None].token_ids == outs[16].token_ids
    for a, b in zip(outs[None].logprobs, outs[16].logprobs, strict=True):
        for tok, lp in b.items():
            assert a[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_platforms_lists_each_platform_default_block_size(capsys):
    from pagedserve.entrypoints.cli.main import main

    assert main(["platforms", "--json"]) == 0
    rows = {p["name"]: p for p in json.loads(capsys.readouterr().out)["platforms"]}
    assert rows["cpu"]["default_block_size"] == CpuPlatform.default_block_size
    assert rows["cuda"]["default_block_size"] == 16
    assert main(["platforms"]) == 0
    assert "BLOCK" in capsys.readouterr().out


def test_the_planner_sizes_blocks_as_the_platform_does():
    from pagedserve.simulate.hardware import load_profile

    assert load_profile("cpu-generic").block_size == CpuPlatform.default_block_size
    assert load_profile("h100-sxm").block_size == 16
