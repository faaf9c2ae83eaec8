"""Freeing the KV blocks that slid out of the window, end to end against transformers.

A tiny random Mistral (window 8, blocks of 4 tokens) generates far past its window in a
pool too small to hold every request's tokens, so freed blocks are reused by other
requests while the table entries that pointed at them now point at the null block
(filled with large random values here: any kernel that let them through the window
mask would change the logprobs).  Greedy tokens and logprobs must equal transformers'
float32 ones with prefix caching, prefill chunks longer and shorter than the window,
preemption and n > 1; every request holds a bounded number of blocks and the pool is
whole at the end.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kv_cache.sliding_window import max_blocks_held

transformers = pytest.importorskip("transformers")

from tests.models.test_models_vs_hf import BASE, VOCAB, _init_weights, hf_reference  # noqa: E402

WINDOW = 8
BS = 4
MAX_NEW = [70, 45, 90, 60]

ENGINES = {
    # Chunks longer than the window: a chunk's own early keys slide out inside it.
    "chunk-over-window": dict(max_num_batched_tokens=13, num_gpu_blocks_override=11),
    # Chunks shorter than the window: the window spans several earlier chunks.
    "chunk-under-window": dict(max_num_batched_tokens=5, num_gpu_blocks_override=11),
    # Drafts are scheduled after the verified tokens; rejected ones are trimmed.
    "ngram-drafts": dict(
        max_num_batched_tokens=16,
        num_gpu_blocks_override=13,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    ),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(17)
    shared = [rng.randrange(3, VOCAB) for _ in range(14)]
    own = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 9, 3)]
    return [own[0], own[1], shared + own[2], shared + own[3]]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path = tmp_path_factory.mktemp("mistral-swa")
    write_byte_tokenizer(path)
    config = transformers.MistralConfig(**{**BASE, "sliding_window": WINDOW, "head_dim": 16})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(config)
    _init_weights(model, gemma_norms=False)
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    prompts = _prompts()
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    return path, prompts, expected


def _poison_null_block(llm: LLM) -> None:
    """NaN in the null block: never written, never read (a kernel that gathered it, even
    under a mask, would turn the output into NaN)."""
    eng = llm.llm_engine
    null = eng.kv.null_block.block_id
    for k, v in eng.runner.kv_caches:
        for t in (k, v):
            t[null] = float("nan")


def _check(outs, expected, n: int = 1) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        assert len(out.outputs) == n
        for got in out.outputs:
            assert got.token_ids == tokens, f"prompt {i}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j)


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_long_generation_in_a_small_pool_matches_transformers(engine_kind, mistral):
    path, prompts, expected = mistral
    kw = ENGINES[engine_kind]
    llm = LLM(model=str(path), dtype="float32", block_size=BS, max_model_len=160, enable_prefix_caching=True, **kw)
    eng = llm.llm_engine
    assert eng.kv.sliding_window == WINDOW
    _poison_null_block(llm)
    pool = eng.kv.pool.num_blocks
    # Together the requests' tokens need far more blocks than the pool has.
    assert sum(-(-(len(p) + n) // BS) for p, n in zip(prompts, MAX_NEW)) > 3 * pool
    bound = max_blocks_held(160, BS, WINDOW, kw["max_num_batched_tokens"])
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
        eng.add_request(f"r{i}", p, params)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        for r in eng.scheduler.running:
            assert eng.kv.num_blocks_held(r.request_id) <= bound
        eng.kv.pool.check_invariants()
    _check([outs[f"r{i}"] for i in range(len(prompts))], expected)
    if "speculative_config" in kw:
        assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert eng.kv.num_blocks_in_use == 0 and not eng.kv.req_blocks
    assert eng.scheduler.num_preemptions > 0  # the pool cannot run all four at once
    eng.kv.pool.check_invariants()


def test_prefix_hits_and_n_samples_with_freed_blocks(mistral):
    """A second round finds the prompts in the prefix cache (blocks the first round freed
    when they slid out stay cached); n=2 samples share the prompt's blocks."""
    path, prompts, expected = mistral
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=160,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=48,
        enable_prefix_caching=True,
    )
    eng = llm.llm_engine
    _poison_null_block(llm)
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    for _ in range(2):
        _check(llm.generate(prompts, params, use_tqdm=False), expected, n=2)
        assert eng.kv.num_blocks_in_use == 0
    assert eng.kv.prefix_hits > 0
    # 8 sequences of up to 120 tokens: 30 blocks each without freeing.
    assert eng.kv.peak_blocks_in_use <= 8 * max_blocks_held(160, BS, WINDOW, 16)
    eng.kv.pool.check_invariants()


def test_freeing_off_keeps_every_block(mistral):
    path, prompts, expected = mistral
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=160,
        num_gpu_blocks_override=64,
        free_sliding_window_blocks=False,
    )
    assert llm.llm_engine.kv.sliding_window is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW[2], ignore_eos=True, logprobs=0)
    _check(llm.generate([prompts[2]], params, use_tqdm=False), expected[2:3])
    assert llm.llm_engine.kv.peak_blocks_in_use == -(-(len(prompts[2]) + MAX_NEW[2] - 1) // BS)


def test_host_tier_with_freeing_is_refused_before_weights_load(mistral):
    path, _, _ = mistral
    with pytest.raises(ValueError, match="free_sliding_window_blocks"):
        LLM(model=str(path), dtype="float32", kv_offload_memory="1MiB", kv_cache_memory="4MiB")
