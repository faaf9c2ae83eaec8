"""Sampling through the engine: seeds, n > 1, stop strings and tokens, logprobs, penalties."""

from __future__ import annotations

import math

import pytest
import torch
from hf_reference import hf_logits, load_hf

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="32MiB", block_size=4)


PROMPT = [5, 77, 120, 33, 9, 200, 41]


def test_same_seed_same_text_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)
    batch = llm.generate([[9, 9, 9], PROMPT, [4, 5]], [others, p, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = (
        llm.generate(
            [PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone


@pytest.mark.compat("n_best_of", "single")
def test_n_samples_share_prompt_blocks_and_differ(llm):
    eng = llm.llm_engine
    hits_before = eng.kv.prefix_hits
    prompt = list(range(10, 30))  # 5 full blocks of 4
    out = llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Siblings 1..3 reuse the 4 full prompt blocks (the last token is always recomputed).
    assert eng.kv.prefix_hits - hits_before >= 3 * 16
    assert eng.kv.pool.num_in_use == 0


def test_greedy_n_gives_identical_samples(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


def test_stop_strings_are_cut_and_matched_across_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = base.text
    assert len(text) >= 6
    # A stop string spanning the boundary of two (byte-level) tokens.
    stop = text[3:6]
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    keep = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert keep.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_min_tokens_and_length(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    tok = base.token_ids[4]
    first = base.token_ids.index(tok)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[tok]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    # min_tokens bans the stop token until reached.
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[tok], min_tokens=first + 2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert tok not in out.token_ids[: first + 2]


def test_logprobs_match_reference_log_softmax(llm, tiny_llama):
    k = 5
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k), use_tqdm=False
    )[0].outputs[0]
    ref = torch.log_softmax(hf_logits(load_hf(tiny_llama), PROMPT + out.token_ids), dim=-1)
    n = len(PROMPT)
    assert len(out.logprobs) == 6
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[n - 1 + i]
        assert math.isclose(entry[tok].logprob, float(row[tok]), abs_tol=1e-3)
        assert entry[tok].rank == 1  # greedy picks the top token
        top_ids = row.topk(k).indices.tolist()
        assert set(entry) == set(top_ids) | {tok}
        for tid in top_ids:
            assert math.isclose(entry[tid].logprob, float(row[tid]), abs_tol=1e-3)
        total += float(row[tok])
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-2)


def test_top_k_1_equals_greedy_and_penalties_change_output(llm):
    greedy = (
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    topk1 = (
        llm.generate(
            [PROMPT], SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert topk1 == greedy
    tiny_p = (
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert tiny_p == greedy
    rep = (
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    # A strong frequency penalty makes repeats rarer than in the greedy text.
    assert len(set(rep)) >= len(set(greedy))
    assert rep != greedy or len(set(greedy)) == len(greedy)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=50), "logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_alone_and_leak_nothing(llm):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * eng.max_model_len], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)
    # Through the engine API: the bad request fails, the good one is unaffected.
    eng.add_request("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("bad", [1, -5], SamplingParams())
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].request_id == "good" and len(outs[-1].outputs[0].token_ids) == 4
    assert eng.kv.pool.num_in_use == 0


def test_abort_mid_generation_frees_blocks(llm):
    eng = llm.llm_engine
    for i in range(3):
        eng.add_request(f"ab{i}", PROMPT + [i], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.pool.num_in_use > 0
    eng.abort_request(["ab0", "ab1"])
    eng.abort_request("ab2")
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()
