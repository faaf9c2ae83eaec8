"""Prefix caching for hybrid models (recurrent-state checkpoints, kv_cache/state_group.py)
against transformers, float32, on the tiny random checkpoints of
test_models_hybrid_vs_hf.py.

A second request that shares a prefix of several blocks with a first one hits (the hit
ends at a checkpoint boundary: counted by the engine's stats and the output's
``num_cached_tokens``) and still gives transformers' greedy tokens and logprobs: whole
prompts (checkpoints inside one step's chunk), chunks smaller than the checkpoint
interval and larger ones, preemption, ``n=2``, short prompts, prompt logprobs (never a
hit) and cache salts (a different salt misses).  Every run ends with every page back in
the pool.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_models_hybrid_vs_hf import MAX_NEW as FEATURE_NEW
from test_models_hybrid_vs_hf import VOCAB, build_checkpoint, hf_reference
from test_models_hybrid_vs_hf import _prompts as feature_prompts

from pagedserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

BS, INTERVAL = 4, 2  # a checkpoint every 8 tokens
COMMON = dict(dtype="float32", kv_cache_memory="16MiB", block_size=BS, state_checkpoint_interval=INTERVAL)
ENGINES = {
    # Whole prompts: every checkpoint of a prompt falls inside its one chunk.
    "whole": dict(max_num_batched_tokens=512),
    # Chunks of 6 tokens, fewer than the 8 between checkpoints.
    "chunks-6": dict(max_num_batched_tokens=6),
    # Chunks of 20 tokens: two or three checkpoints inside some chunks, at various offsets.
    "chunks-20": dict(max_num_batched_tokens=20),
}
MAX_NEW = 8


def _prompts(seed: int) -> tuple[list[int], list[int], list[int]]:
    """A (61 tokens), B sharing A's first 45 tokens, then 20 of its own; and a short C (12
    tokens) sharing A's first 10."""
    rng = random.Random(seed)
    a = [rng.randrange(3, VOCAB) for _ in range(61)]
    b = a[:45] + [rng.randrange(3, VOCAB) for _ in range(20)]
    c = a[:10] + [rng.randrange(3, VOCAB) for _ in range(2)]
    return a, b, c


def cached_references(tmp_path_factory, build):
    """``get(case, prefix=False)`` -> (checkpoint folder, prompts, transformers' greedy
    tokens and logprobs), each case built once by ``build(path, case)`` (which returns the
    transformers model): the feature prompts of test_models_hybrid_vs_hf.py, or
    (``prefix``) this module's prefix-sharing prompts with ``MAX_NEW`` new tokens each."""
    cache: dict[tuple, tuple] = {}

    def get(case: str, prefix: bool = False):
        key = (case, prefix)
        if key not in cache:
            path = tmp_path_factory.mktemp(case)
            model = build(path, case)
            if prefix:
                prompts = _prompts(len(case))
                expected = [hf_reference(model, p, MAX_NEW) for p in prompts]
            else:
                prompts = feature_prompts(len(case))
                expected = [hf_reference(model, p, n) for p, n in zip(prompts, FEATURE_NEW)]
            cache[key] = (path, prompts, expected)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            model = build_checkpoint(path, case)
            prompts = _prompts(len(case))
            cache[case] = (path, model, prompts, [hf_reference(model, p, MAX_NEW) for p in prompts])
        return cache[case]

    return get


def _params(n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, **kw)


def _run(eng, rid: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None):
    eng.add_request(rid, None, params, prompt_token_ids=prompt, cache_salt=cache_salt)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final


def _check(out, expected, what: str) -> None:
    tokens, logprobs = expected
    for got in out.outputs:
        assert got.token_ids == tokens, what
        for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (what, j)


def _no_leaks(eng) -> None:
    pool = eng.kv.pool
    assert pool.num_in_use == 0 and pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def _hit_then_check(eng, prompts, expected, what: str) -> None:
    """A, then B (hits A's checkpoint at 40 tokens: 45 shared, a boundary every 8), then
    C (12 tokens, 10 shared: hits at 8), each equal to transformers."""
    hits = eng.kv.prefix_hits
    out_a = _run(eng, "a", prompts[0], _params())
    _check(out_a, expected[0], f"{what}: cold")
    out_b = _run(eng, "b", prompts[1], _params())
    assert out_b.num_cached_tokens == 40, what
    assert eng.stats().prefix_cache_hits - hits >= 40
    _check(out_b, expected[1], f"{what}: after a hit")
    out_c = _run(eng, "c", prompts[2], _params())
    assert out_c.num_cached_tokens == 8, what  # a short prompt hits too
    _check(out_c, expected[2], f"{what}: short prompt")
    _no_leaks(eng)


FULL = ["qwen3_5-deltanet-gated-attn", "granite4-mamba2-moe-nope"]


@pytest.mark.parametrize("engine_kind", list(ENGINES))
@pytest.mark.parametrize("case", FULL)
def test_prefix_hits_match_transformers(case, engine_kind, hybrid):
    path, _, prompts, expected = hybrid(case)
    llm = LLM(model=str(path), **COMMON, **ENGINES[engine_kind])
    eng = llm.llm_engine
    assert eng.kv.enable_prefix_caching  # on by default
    _hit_then_check(eng, prompts, expected, engine_kind)
    assert sum(g.num_checkpoints for g in eng.kv.state_groups) > 0


#: The other families, once each; the Qwen3.5 variants (the DeltaNet path tested above) are slow.
OTHERS = [
    "nemotronh-mamba2-mlp-attn",
    "lfm2-shortconv-bias-attn",
    "jamba-mamba1-moe-attn",
    pytest.param("qwen3_5-tied-mixed-order", marks=pytest.mark.slow),
    pytest.param("qwen3_5moe-experts-every-layer", marks=pytest.mark.slow),
    pytest.param("qwen3next-moe-shared-expert", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", OTHERS)
def test_prefix_hits_every_family(case, hybrid):
    path, _, prompts, expected = hybrid(case)
    eng = LLM(model=str(path), **COMMON, **ENGINES["chunks-20"]).llm_engine
    _hit_then_check(eng, prompts, expected, case)


@pytest.mark.parametrize(("case", "pages"), [(FULL[0], 40), (FULL[1], 48)])
def test_prefix_caching_under_preemption_and_n2(case, pages, hybrid):
    """A pool of a few pages more than one 80-token request needs with its state pages
    (20 blocks of 4 tokens, 9 or 12 state pages; each checkpoint takes as many as a
    request's state): the three prompts and two samples of each at once preempt one
    another; recomputed requests may hit checkpoints, their own included."""
    path, _, prompts, expected = hybrid(case)
    llm = LLM(model=str(path), **COMMON, max_num_batched_tokens=16, num_gpu_blocks_override=pages, max_model_len=80)
    eng = llm.llm_engine
    outs = llm.generate(list(prompts), [_params(n=2)] * 3, use_tqdm=False)
    for i, out in enumerate(outs):
        assert len(out.outputs) == 2
        _check(out, expected[i], f"prompt {i}")
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.prefix_hits > 0
    _no_leaks(eng)


def test_prompt_logprobs_and_cache_salt(hybrid):
    path, model, prompts, expected = hybrid(FULL[0])
    eng = LLM(model=str(path), **COMMON, **ENGINES["chunks-20"]).llm_engine
    _run(eng, "a", prompts[0], _params(), cache_salt="s1")
    # Another salt: no hit.
    assert _run(eng, "b1", prompts[1], _params(), cache_salt="s2").num_cached_tokens == 0
    # The same salt: a hit.
    out = _run(eng, "b2", prompts[1], _params(), cache_salt="s1")
    assert out.num_cached_tokens == 40
    _check(out, expected[1], "salted hit")
    # Prompt logprobs: every prompt position computed, whatever is cached.
    out = _run(eng, "b3", prompts[1], _params(prompt_logprobs=0), cache_salt="s1")
    assert out.num_cached_tokens == 0
    _check(out, expected[1], "prompt logprobs")
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([prompts[1]])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompts[1])
    for pos in range(1, len(prompts[1])):
        tok = prompts[1][pos]
        assert math.isclose(out.prompt_logprobs[pos][tok].logprob, float(ref[pos - 1, tok]), abs_tol=2e-4), pos
    _no_leaks(eng)
