"""Tensor parallelism for Gemma 4 text, float32, on the tiny checkpoints of test_gemma4.py:
two ranks (mp executor, gloo) give transformers' greedy tokens and logprobs, and the
one-process engine's, with chunked prefill and a second round that hits the prefix
cache.  The quick case has every released feature (per-layer embeddings, KV sharing,
the MoE block) and full-attention layers with one KV head of their own head size
(``attention_k_eq_v``), which both ranks keep while the sliding layers' two KV heads
split; the other splits four KV heads on the sliding layers and two on the full
ones, with a cache of two heads per rank; load-time int8 at two ranks gives what it
gives in one process, and recompute preemption with n=2 and n-gram drafts match
transformers at two ranks (both slow).  Per-layer KV head counts the ranks cannot
split are refused when the config is read, naming the layer and the count."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from test_gemma4 import MOE, PLE, SHARED, SIX, TEXT, _build, _expected

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_parallel_fits_model
from pagedserve.models.arch_config import ArchConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)

#: The full layers' values are their keys (one KV head of 32) beside the sliding layers'
#: two KV heads of 16.
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)
CASES = {
    "all-features-k-eq-v": dict(**PLE, **SHARED, **MOE, **K_EQ_V),
    "kv4-global-kv2": dict(**MOE, num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=2),
}

ENGINE = dict(
    dtype="float32", kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True
)


def _generate(path, prompts, **parallel) -> tuple[list[tuple[list[int], list[float]]], dict]:
    from test_models_vs_hf import MAX_NEW

    llm = LLM(model=str(path), **ENGINE, **parallel)
    try:
        eng = llm.llm_engine
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_NEW]
        rounds = []
        for _ in range(2):  # the second round hits the prefix cache
            outs = llm.generate(prompts, params[: len(prompts)], use_tqdm=False)
            rounds += [
                (
                    list(x.outputs[0].token_ids),
                    [e[t].logprob for t, e in zip(x.outputs[0].token_ids, x.outputs[0].logprobs)],
                )
                for x in outs
            ]
        facts = dict(
            hits=eng.kv.prefix_hits,
            in_use=eng.kv.pool.num_in_use,
            kv_heads=eng.runner.model.num_kv_heads,
            local_shapes=list(eng.runner.model.local_shapes),
        )
    finally:
        llm.shutdown()
    return rounds, facts


def _same(got, want, tol: float, what: str) -> None:
    assert len(got) == len(want)
    for i, ((tokens, lps), (ref_tokens, ref_lps)) in enumerate(zip(got, want)):
        assert tokens == ref_tokens, f"{what}: prompt {i}"
        for j, (a, b) in enumerate(zip(lps, ref_lps)):
            assert math.isclose(a, b, abs_tol=tol), (what, i, j, a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_one_process_and_transformers(case, tmp_path):
    """About 10 s each on 2 busy cores (a one-process engine, then two ranks)."""
    model = _build(tmp_path, **CASES[case])
    prompts, expected = _expected(model, len(case))
    expected = expected + expected
    one, one_facts = _generate(tmp_path, prompts)
    _same(one, expected, 2e-4, "one process vs transformers")
    two, two_facts = _generate(tmp_path, prompts, tensor_parallel_size=2, distributed_executor_backend="mp")
    _same(two, expected, 2e-4, "TP=2 vs transformers")
    _same(two, one, 1e-4, "TP=2 vs one process")
    assert two_facts["hits"] > 0 and two_facts["in_use"] == 0
    # Rank 0's cache holds half the heads (at least one); each layer its share of its own.
    assert two_facts["kv_heads"] == max(1, one_facts["kv_heads"] // 2)
    for (d1, kv1, _), (d2, kv2, first) in zip(one_facts["local_shapes"], two_facts["local_shapes"]):
        assert d2 == d1 and kv2 == max(1, kv1 // 2) and first == 0
    assert not dist.is_initialized()


@pytest.mark.slow
def test_tp2_int8_matches_one_process(tmp_path):
    """Load-time int8: each rank quantizes its own rows of the column-parallel weights and
    keeps whole rows (with their scales) of the row-parallel ones' columns."""
    from pagedserve.quantization import Int8Weight

    _build(tmp_path, **CASES["all-features-k-eq-v"])
    prompts = [[5, 9, 100, 31, 7, 8, 200, 44, 3, 17, 19, 23, 5, 9, 100], [50, 60, 70]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    got = []
    for parallel in ({}, dict(tensor_parallel_size=2, distributed_executor_backend="mp")):
        llm = LLM(model=str(tmp_path), **ENGINE, quantization="int8", **parallel)
        try:
            assert isinstance(llm.llm_engine.runner.model.layers[0].q, Int8Weight)
            outs = llm.generate(prompts, params, use_tqdm=False)
            got.append(
                [
                    (
                        list(o.outputs[0].token_ids),
                        [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
                    )
                    for o in outs
                ]
            )
        finally:
            llm.shutdown()
    _same(got[1], got[0], 1e-4, "int8 TP=2 vs int8 one process")
    assert not dist.is_initialized()


@pytest.mark.slow
def test_tp2_preemption_n2_and_ngram_drafts_match_transformers(tmp_path):
    """test_gemma4's preemption and n-gram cases at two ranks: recompute preemption with
    two samples a request, then repeating prompts whose drafts are mostly rejected."""
    from test_gemma4 import _check, _reference

    model = _build(tmp_path, **CASES["all-features-k-eq-v"])
    prompts, expected = _expected(model, 7)
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=10,
        max_model_len=80,
        **tp,
    )
    try:
        _check(llm, prompts, expected, n=2)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42] * 5 + [40], [100, 101, 102, 103] * 3]
    expected = [_reference(model, p, m) for p, m in zip(prompts, (9, 14, 6))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    llm = LLM(model=str(tmp_path), **{**ENGINE, "max_num_batched_tokens": 16}, speculative_config=spec, **tp)
    try:
        _check(llm, prompts, expected)
        assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def _hf(**change) -> dict:
    cfg = transformers.Gemma4TextConfig(**{**TEXT, **SIX, **change}).to_dict()
    return {**cfg, "architectures": ["Gemma4ForCausalLM"]}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            dict(num_attention_heads=6, num_key_value_heads=6, attention_k_eq_v=True, num_global_key_value_heads=3),
            "layer 1 (full_attention) has 3 KV heads",
        ),
        ({**MOE, "moe_intermediate_size": 33}, "moe_intermediate_size (33)"),
    ],
)
def test_counts_the_ranks_cannot_split_are_refused_when_the_config_is_read(change, named):
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    arch = ArchConfig.from_hf(_hf(**change))
    with pytest.raises(ValueError, match="tensor_parallel_size=2") as err:
        check_parallel_fits_model(cfg, arch)
    assert named in str(err.value)
    cfg.parallel.tensor_parallel_size = 1
    check_parallel_fits_model(cfg, arch)


def test_counts_that_split_pass_the_check():
    for change in ({}, K_EQ_V, dict(num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=2)):
        arch = ArchConfig.from_hf(_hf(**change))
        assert arch.tensor_parallel
        for tp in (2, 4):
            cfg = EngineConfig()
            cfg.parallel.tensor_parallel_size = tp
            check_parallel_fits_model(cfg, arch)
