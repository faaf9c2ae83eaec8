"""Greedy output with speculative decoding equals greedy output without it, token for
token (and logprobs close), for every proposer, on tiny random checkpoints, with prefix
caching, chunked prefill and preemption in play."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

# Repetitive prompts make n-gram lookup (and so acceptances and rejections) frequent.
PROMPTS = [
    [5, 77, 120, 33, 9, 200, 41, 5, 77, 120, 33, 9, 200, 41, 5, 77, 120],
    [9, 9, 9, 9, 9, 9],
    list(range(10, 60)) + list(range(10, 30)),
    [31, 4, 31, 4, 31, 4, 31, 4, 100, 101, 102, 31, 4, 100],
]
KW = dict(dtype="float32", block_size=4, threads=1)


def _tokens(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def _spec(kind: str, draft) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def target(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(seed=0)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target with noise on every weight: it agrees with the target often but not
    always, so verification both accepts and rejects."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("noisy-draft")
    shutil.copytree(target, path, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(path / "model.safetensors"))
    noisy = {
        k: v + 0.6 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(noisy, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def baseline(target):
    return LLM(model=str(target), kv_cache_memory="32MiB", **KW)


@pytest.mark.compat("spec_ngram", "single")
@pytest.mark.compat("spec_draft_model", "single")
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_greedy_equal_with_prefix_caching_and_chunked_prefill(kind, target, draft, baseline):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    want, want_outs = _tokens(baseline, PROMPTS, params)
    # A small step budget chunks the prompts and limits the drafts some steps carry.
    llm = LLM(
        model=str(target),
        kv_cache_memory="32MiB",
        max_num_batched_tokens=24,
        speculative_config=_spec(kind, draft),
        **KW,
    )
    for _ in range(2):  # the second round hits the prefix cache
        got, outs = _tokens(llm, PROMPTS, params)
        assert got == want
        for o, w in zip(outs, want_outs):
            for tok, lp, wlp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, w.outputs[0].logprobs):
                assert lp[tok].logprob == pytest.approx(wlp[tok].logprob, abs=1e-4)
                assert set(lp) == set(wlp)
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.prefix_cache_hits > 0
    assert llm.llm_engine.kv.pool.num_in_use == 0


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_greedy_equal_under_preemption_and_n(kind, target, draft, baseline):
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, n=2)
    want, _ = _tokens(baseline, PROMPTS, params)
    # 32 blocks of 4 tokens cannot hold all eight sequences at full length: preemptions.
    llm = LLM(
        model=str(target), num_gpu_blocks_override=32, max_model_len=128, speculative_config=_spec(kind, draft), **KW
    )
    got, _ = _tokens(llm, PROMPTS, params)
    assert got == want
    assert llm.llm_engine.stats().num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_in_use == 0
    if kind == "draft_model":
        assert llm.llm_engine.spec.proposer.kv.pool.num_in_use == 0


def test_stops_inside_accepted_drafts(target, baseline):
    """A stop token or max_tokens reached among accepted drafts ends the output there."""
    prompt = PROMPTS[0]
    free, _ = _tokens(baseline, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop_at = free[0][0][7]
    llm = LLM(model=str(target), kv_cache_memory="32MiB", speculative_config=_spec("ngram", None), **KW)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ):
        want, _ = _tokens(baseline, [prompt], params)
        got, outs = _tokens(llm, [prompt], params)
        assert got == want
        assert outs[0].outputs[0].finish_reason == ("stop" if params.stop_token_ids else "length")
    assert llm.llm_engine.kv.pool.num_in_use == 0


def test_stop_strings_and_text(target, baseline):
    prompt = "abcabcabcabcabc"
    free = (
        baseline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = free[5:8]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True)
    want = baseline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(model=str(target), kv_cache_memory="32MiB", speculative_config=_spec("ngram", None), **KW)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


def test_qwen2_draft_for_llama_target(tiny_checkpoint_factory, target, baseline):
    """Any architecture we load drafts, as long as the vocabulary matches."""
    qwen = tiny_checkpoint_factory(arch="qwen2", seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want, _ = _tokens(baseline, PROMPTS, params)
    llm = LLM(
        model=str(target),
        kv_cache_memory="32MiB",
        **KW,
        speculative_config={"model": str(qwen), "num_speculative_tokens": 2},
    )
    got, _ = _tokens(llm, PROMPTS, params)
    assert got == want


def test_penalties_and_min_tokens_see_the_drafts(target, draft, baseline):
    """Penalties and min_tokens at each draft position count the drafts before it (a
    draft model: penalised outputs rarely repeat, so n-gram lookup would rarely draft)."""
    eos = sorted(baseline.llm_engine.eos_token_ids)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.6, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=0.8, min_tokens=12, stop_token_ids=eos),
    ]
    want, _ = _tokens(baseline, PROMPTS[:2], params)
    llm = LLM(model=str(target), kv_cache_memory="32MiB", speculative_config=_spec("draft_model", draft), **KW)
    got, _ = _tokens(llm, PROMPTS[:2], params)
    assert got == want
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0
