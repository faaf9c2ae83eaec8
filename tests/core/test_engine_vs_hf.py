"""End to end, float32: greedy token ids identical to transformers on tiny random
checkpoints across shapes, batch compositions, chunked prefill, prefix caching and
forced preemption."""

from __future__ import annotations

import random

import pytest
from hf_reference import hf_greedy, load_hf

from pagedserve import LLM, SamplingParams

SHAPES = {
    "llama-gqa2": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "llama-mha-tied": dict(arch="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama-gqa4-head32": dict(arch="llama", hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=32),
    "llama3-rope": dict(
        arch="llama",
        num_heads=2,
        num_kv_heads=1,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias-gqa4": dict(arch="qwen2", num_heads=4, num_kv_heads=1),
}

ENGINES = {
    "chunked+prefix": dict(max_num_batched_tokens=24, enable_prefix_caching=True, block_size=4),
    "no-prefix-big-budget": dict(max_num_batched_tokens=2048, enable_prefix_caching=False, block_size=16),
    # ~11 blocks of 8 tokens for 6 requests of up to ~45 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=11,
        max_model_len=88,
    ),
}


def make_prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 30)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 9)]
    return prompts


@pytest.fixture(scope="module")
def hf_cache():
    return {}


@pytest.mark.compat("prefix_caching", "single")
@pytest.mark.compat("chunked_prefill", "single")
@pytest.mark.compat("preemption_recompute", "single")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_greedy_matches_transformers(shape, engine_kind, tiny_checkpoint_factory, hf_cache):
    path = tiny_checkpoint_factory(**SHAPES[shape])
    prompts = make_prompts(hash(shape) % 1000, 259)
    max_new = [12, 20, 7, 16, 10, 14]
    key = (shape,)
    if key not in hf_cache:
        model = load_hf(path)
        hf_cache[key] = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    expected = hf_cache[key]

    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="64MiB", **ENGINES[engine_kind])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    eng = llm.llm_engine
    if engine_kind == "preempting":
        assert eng.scheduler.num_preemptions > 0
    # Every block came back.
    assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()

    # A second round reuses cached prefixes (when enabled) and changes nothing.
    outs2 = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs2] == expected[::-1]
    if ENGINES[engine_kind]["enable_prefix_caching"]:
        assert eng.kv.prefix_hits > 0


def test_batch_composition_does_not_change_outputs(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPES["llama-gqa2"])
    prompts = make_prompts(3, 259)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=16, block_size=4)
    p = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    alone = [llm.generate([pr], p, use_tqdm=False)[0].outputs[0].token_ids for pr in prompts]
    assert together == alone
