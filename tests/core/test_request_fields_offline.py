"""Offline request fields: logit_bias, allowed_token_ids, bad_words, prompt_logprobs,
best_of, truncate_prompt_tokens, priority scheduling, generation_config defaults, and the
validation of numbers, seeds and token ids (NaN, int64, vocabulary)."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import SchedulerConfig
from pagedserve.executor.logits_processors import apply_logits_processors, bad_words_token_ids
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.scheduler import Scheduler

# 16-token blocks: the preemption and prefix-cache cases below count in them.
ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB", "threads": 1, "block_size": 16}
VOCAB = 259  # the tiny checkpoint's byte tokenizer: 3 specials + 256 bytes
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), **ENGINE)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def gen(llm, prompt=PROMPT, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 6)
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits at every position: [len(ids), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# -- validation (issue 21 items 2-4) ------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_fields_reject_nan_and_infinity(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be a finite number"):
        SamplingParams(**{name: value})


def test_logit_bias_rejects_nan_and_clamps():
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={5: math.nan})
    assert SamplingParams(logit_bias={"5": 250.0, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}


@pytest.mark.parametrize("seed", [1 << 64, (1 << 63), -(1 << 63) - 1])
def test_seed_outside_int64_is_refused(seed):
    with pytest.raises(ValueError, match="^seed must be in the int64 range"):
        SamplingParams(seed=seed)


def test_seed_at_int64_limits_with_n_does_not_overflow(llm):
    for seed in ((1 << 63) - 1, -(1 << 63)):
        out = gen(llm, temperature=1.0, seed=seed, n=3, max_tokens=3)
        assert len(out.outputs) == 3 and all(len(c.token_ids) == 3 for c in out.outputs)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(stop_token_ids=[-(10**20)], min_tokens=2), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(logit_bias={-2: 1.0}), "logit_bias"),
    ],
)
def test_negative_token_ids_are_refused(kw, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(stop_token_ids=[VOCAB], min_tokens=2), "stop_token_ids"),
        (dict(allowed_token_ids=[5, 10**12]), "allowed_token_ids"),
        (dict(logit_bias={VOCAB + 7: 1.0}), "logit_bias"),
    ],
)
def test_token_ids_beyond_the_vocabulary_are_refused(llm, kw, name):
    with pytest.raises(ValueError, match=f"^{name} contains token id .* outside the vocabulary"):
        gen(llm, **kw)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, -1]], SamplingParams(), use_tqdm=False)


# -- logits processors ----------------------------------------------------------------------------
def _reference_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Row by row, the obvious way."""
    out = logits.clone()
    for i, r in enumerate(requests):
        p = r.sampling_params
        if p.allowed_token_ids is not None:
            mask = torch.full_like(out[i], float("-inf"))
            mask[p.allowed_token_ids] = 0.0
            out[i] = out[i] + mask
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
        for seq in getattr(p, "_bad_words_token_ids", None) or ():
            if (
                list(r.output_token_ids[len(r.output_token_ids) - len(seq) + 1 :]) == seq[:-1]
                and len(r.output_token_ids) >= len(seq) - 1
            ):
                out[i, seq[-1]] = float("-inf")
    return out


def test_logits_processors_match_a_row_by_row_reference():
    rng = random.Random(0)
    vocab = 50
    requests = []
    for i in range(12):
        kw = {}
        if rng.random() < 0.5:
            kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randrange(1, 4))}
        if rng.random() < 0.4:
            kw["allowed_token_ids"] = rng.sample(range(vocab), rng.randrange(1, 6))
        if rng.random() < 0.5:
            kw["bad_words"] = ["x"]
        p = SamplingParams(**kw)
        p._bad_words_token_ids = [[rng.randrange(vocab)], [3, 4, rng.randrange(vocab)]] if "bad_words" in kw else None
        r = Request(f"r{i}", [1, 2], p)
        for t in rng.choice([[], [3], [3, 4], [9, 3, 4], [4]]):
            r.append_token(t)
        requests.append(r)
    logits = torch.randn(len(requests), vocab)
    got = apply_logits_processors(logits, requests)
    torch.testing.assert_close(got, _reference_processors(logits, requests), rtol=0, atol=1e-6)


def test_bad_words_tokenization_adds_the_spaced_variant():
    enc = {"ab": [1, 2], " ab": [7, 2], "x": [9], " x": [9]}.__getitem__
    assert bad_words_token_ids(["ab", "x"], enc) == [[1, 2], [7, 2], [9]]


def test_logit_bias_and_allowed_token_ids_steer_greedy_output(llm):
    base = gen(llm).outputs[0].token_ids
    forced = gen(llm, logit_bias={base[0] + 1: 100.0}).outputs[0].token_ids
    assert forced == [base[0] + 1] * 6
    allowed = [40, 50, 60]
    out = gen(llm, allowed_token_ids=allowed, n=2, temperature=1.0, seed=3).outputs
    assert all(t in allowed for c in out for t in c.token_ids)


@pytest.mark.compat("logits_processors", "single")
def test_allowed_token_ids_greedy_matches_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    allowed = [10, 20, 30, 40, 50]
    got = gen(llm, allowed_token_ids=allowed, max_tokens=1).outputs[0].token_ids[0]
    lp = hf_logprobs(hf_model, ids)[-1]
    assert got == allowed[int(lp[allowed].argmax())]


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    letters = [tok.encode(c, add_special_tokens=False)[0] for c in "abcdefghijklmnopqrstuvwxyz"]
    text = gen(llm, max_tokens=12, allowed_token_ids=letters).outputs[0].text
    words = [text[2:4], text[5]]
    out = gen(llm, max_tokens=12, allowed_token_ids=letters, bad_words=words).outputs[0].text
    assert len(out) == 12 and out != text
    assert not any(w in out for w in words)


# -- prompt_logprobs ------------------------------------------------------------------------------
def _check_prompt_logprobs(out, ref: torch.Tensor, k: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        want = ref[pos - 1]
        assert math.isclose(entry[ids[pos]].logprob, float(want[ids[pos]]), abs_tol=2e-4)
        assert entry[ids[pos]].rank == int((want > want[ids[pos]]).sum()) + 1
        top = want.topk(k).indices.tolist()
        assert set(top) <= set(entry)


@pytest.mark.compat("prompt_logprobs", "single")
@pytest.mark.parametrize("budget", [2048, 7])  # 7: the prompt is prefilled in chunks
def test_prompt_logprobs_match_transformers(tiny_llama, hf_model, budget):
    llm = LLM(model=str(tiny_llama), max_num_batched_tokens=budget, **ENGINE)
    prompt = PROMPT + " the lazy dog"
    ids = llm.get_tokenizer().encode(prompt)
    ref = hf_logprobs(hf_model, ids)
    gen(llm, prompt)  # warm the prefix cache: the next request must not use it
    out = gen(llm, prompt, prompt_logprobs=3, n=2, temperature=1.0, seed=1)
    _check_prompt_logprobs(out, ref, 3)
    assert llm.llm_engine.kv.usage() == 0.0


def test_prompt_logprobs_survive_preemption(tiny_llama, hf_model):
    # A cache of 4 blocks of 16 tokens: three requests cannot all grow, so some are preempted.
    llm = LLM(
        model=str(tiny_llama),
        num_gpu_blocks_override=5,
        block_size=16,
        max_model_len=64,
        max_num_seqs=3,
        dtype="float32",
        threads=1,
    )
    prompts = [PROMPT, "Pack my box with", "Sphinx of black quartz"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for out in outs:
        _check_prompt_logprobs(out, hf_logprobs(hf_model, out.prompt_token_ids), 1)


@pytest.mark.parametrize("budget", [2048, 7])
def test_full_prompt_distributions_match_transformers(tiny_llama, hf_model, budget):
    # prompt_logprobs=-1: every position's whole log-distribution, in one tensor, beside a
    # top-k request in the same batch (its entries unchanged), whole prompt or in chunks.
    llm = LLM(model=str(tiny_llama), max_num_batched_tokens=budget, **ENGINE)
    prompts = [PROMPT + " the lazy dog", "Pack my box with five dozen"]
    outs = llm.generate(
        prompts,
        [SamplingParams(max_tokens=2, prompt_logprobs=-1), SamplingParams(max_tokens=2, prompt_logprobs=2)],
        use_tqdm=False,
    )
    full, topk = outs
    ids = full.prompt_token_ids
    ref = hf_logprobs(hf_model, ids)[:-1]
    rows = full.prompt_logprob_rows
    assert rows.dtype == torch.float32 and rows.shape == (len(ids) - 1, VOCAB)
    torch.testing.assert_close(rows, ref, atol=2e-4, rtol=0)
    for pos in range(1, len(ids)):  # the entries hold the token's own logprob and rank alone
        assert set(full.prompt_logprobs[pos]) == {ids[pos]}
        assert full.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(float(rows[pos - 1, ids[pos]]), abs=1e-6)
    assert topk.prompt_logprob_rows is None
    _check_prompt_logprobs(topk, hf_logprobs(hf_model, topk.prompt_token_ids), 2)
    assert llm.llm_engine.kv.usage() == 0.0


@pytest.mark.parametrize("bad", [-2, 21])
def test_prompt_logprobs_range(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


# -- best_of, truncate_prompt_tokens ----------------------------------------------------------------
def test_best_of_returns_the_best_candidates_by_cumulative_logprob(llm):
    seed = 11
    out = gen(llm, temperature=1.0, seed=seed, n=2, best_of=5, max_tokens=5)
    # Sample i of a seeded request draws with seed + i: the same as n=1 requests with those seeds.
    candidates = [gen(llm, temperature=1.0, seed=seed + i, max_tokens=5, logprobs=0).outputs[0] for i in range(5)]
    best = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)
    with pytest.raises(ValueError, match="^best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    out = gen(llm, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == ids[-5:]
    assert (
        out.outputs[0].token_ids
        == llm.generate([ids[-5:]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    )


# -- priority ---------------------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="^priority 3 needs scheduling_policy='priority'"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False, priority=[3])


def test_priority_policy_serves_lower_values_first(tiny_llama):
    llm = LLM(model=str(tiny_llama), scheduling_policy="priority", max_num_seqs=1, **ENGINE)
    engine = llm.llm_engine
    for rid, prio in (("a", 2), ("b", 0), ("c", 1)):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=3, temperature=0), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["b", "c", "a"]


def test_priority_preemption_takes_the_lowest_priority_and_requeues_in_order():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="priority"), kv, 64)

    def req(rid, prio, start):
        return Request(
            rid,
            list(range(start, start + 4)),
            SamplingParams(max_tokens=20, ignore_eos=True),
            arrival_time=start,
            priority=prio,
        )

    for r in (req("urgent", 0, 0), req("low", 9, 10), req("mid", 5, 20)):
        s.add_request(r)
    out = s.schedule()  # three prompts of one block each
    s.update_after_step(out, {x.request.request_id: 1 for x in out.scheduled})
    s.add_request(req("late", 1, 30))
    out = s.schedule()  # each decode needs a second block; only one is free
    assert out.preempted[0] == "low"
    # FCFS would put the preempted request back in front; priority keeps (priority, arrival) order.
    assert [r.request_id for r in s.waiting] == ["late", "low"]


# -- generation_config ------------------------------------------------------------------------------
def test_generation_config_defaults_apply_unless_ignored(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update({"temperature": 1.0, "top_k": 1, "max_new_tokens": 5, "repetition_penalty": 1.3})
    (model / "generation_config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(model), **ENGINE)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens, d.repetition_penalty) == (1.0, 1, 5, 1.3)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    greedy = gen(llm, max_tokens=5, repetition_penalty=1.3).outputs[0]
    assert out.token_ids == greedy.token_ids  # top_k=1 at temperature 1 is greedy
    ignored = LLM(model=str(model), generation_config="ignore", **ENGINE)
    assert ignored.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(model=str(model), generation_config=str(tmp_path / "missing"), **ENGINE)


# -- beam search ------------------------------------------------------------------------------------
def _reference_beam_search(
    hf_model, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float = 1.0
) -> list[tuple[list[int], float]]:
    """Beam search over transformers' logits, written out plainly."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for tokens, cum in live:
            lp = hf_logprobs(hf_model, tokens)[-1]
            vals, idx = lp.topk(2 * width)
            for v, t in zip(vals.tolist(), idx.tolist()):
                (done if t == eos else cands).append((tokens + [t], cum + v))
        live = sorted(cands, key=lambda b: b[1], reverse=True)[:width]

    def score(b):
        n = len(b[0]) - (1 if b[0][-1] == eos else 0)
        return b[1] / n**length_penalty

    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.compat("beam_search", "single")
@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_matches_a_reference_over_transformers(llm, hf_model, length_penalty):
    from pagedserve.beam_search import BeamSearchParams

    prompts = [PROMPT, "Sphinx of black quartz, judge my vow"]
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty)
    outs = llm.beam_search(prompts, params)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        ref = _reference_beam_search(hf_model, ids, 3, 4, eos=2, length_penalty=length_penalty)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, (_, cum) in zip(out.sequences, ref):
            assert math.isclose(s.cum_logprob, cum, abs_tol=1e-3)
            assert s.text == tok.decode(s.tokens[len(ids) :])
    assert llm.llm_engine.kv.usage() == 0.0


@pytest.mark.parametrize("length_penalty", [1e6, -1e6, 400.0])
def test_beam_search_survives_extreme_length_penalties(llm, length_penalty):
    # length ** penalty overflows (1e6, 400 at 6+ tokens) or underflows to 0 (-1e6) in
    # float arithmetic: the scores saturate and still rank, nothing raises.
    from pagedserve.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty)
    (out,) = llm.beam_search([PROMPT], params)
    assert len(out.sequences) == 3 and all(s.cum_logprob <= 0 for s in out.sequences)
    assert llm.llm_engine.kv.usage() == 0.0


def test_length_penalized_is_the_plain_score_where_that_is_finite():
    from pagedserve.beam_search import length_penalized

    for cum, n, lp in [(-3.0, 10, 1.0), (-1.5, 7, 0.5), (-20.0, 300, 2.0), (-0.25, 3, -1.0), (0.0, 9, 3.0)]:
        assert length_penalized(cum, n, lp) == cum / n**lp
    assert length_penalized(-3.0, 2000, 1e6) == 0.0  # 2000 ** 1e6 overflows
    assert length_penalized(-3.0, 2000, -1e6) == -math.inf  # 2000 ** -1e6 underflows to 0
    assert length_penalized(0.0, 2000, -1e6) == 0.0


def test_beam_search_shares_prefix_blocks(llm):
    from pagedserve.beam_search import BeamSearchParams

    engine = llm.llm_engine
    hits = engine.kv.prefix_hits
    prompt = "a long prompt that fills more than one block of sixteen tokens"
    outs = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6))
    assert engine.kv.prefix_hits > hits  # later steps reuse the prompt's cached blocks
    assert len(outs[0].sequences) == 2


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beam_search_completes_beams_at_eos(ignore_eos):
    from pagedserve.beam_search import BeamSearch, BeamSearchParams
    from pagedserve.outputs import Logprob

    search = BeamSearch(
        [[1, 1]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=ignore_eos), frozenset({2}), max_model_len=100
    )
    lps = {2: -0.1, 5: -1.0, 6: -2.0, 7: -3.0}
    search.run(lambda todo, _: [{t: Logprob(v) for t, v in lps.items()} for _ in todo])
    seqs = search.outputs(lambda t: ",".join(map(str, t)))[0].sequences
    if ignore_eos:
        assert [s.tokens for s in seqs] == [[1, 1, 2, 2, 2], [1, 1, 2, 2, 5]]
        assert [s.finish_reason for s in seqs] == ["length", "length"]
    else:  # [1, 1, 2] scores -0.1 / 2 (EOS not counted): the best
        assert [s.tokens for s in seqs] == [[1, 1, 2], [1, 1, 5, 2]]
        assert [s.finish_reason for s in seqs] == ["stop", "stop"]
        assert seqs[0].text == "" and seqs[1].text == "5"
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=math.nan)


def test_chat_continue_final_message_and_template_kwargs(llm):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    params = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("Hel")
    ref = llm.generate(
        {"prompt_token_ids": llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)}, params, use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, params, use_tqdm=False, continue_final_message=True)
    out = llm.chat(
        conv[:1], params, use_tqdm=False, chat_template="<{{ flag }}>", chat_template_kwargs={"flag": "XYZ"}
    )[0]
    assert out.prompt == "<XYZ>"


def test_logits_processors_are_unchanged_by_preemption_and_chunking(tiny_llama, llm):
    small = LLM(
        model=str(tiny_llama),
        num_gpu_blocks_override=5,
        block_size=16,
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        dtype="float32",
        threads=1,
    )
    tok = llm.get_tokenizer()
    letters = [tok.encode(c, add_special_tokens=False)[0] for c in "abcdefghij"]
    prompts = [PROMPT, "Pack my box with", "Sphinx of black quartz"]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=letters, bad_words=["ab", "c"]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={letters[3]: 5.0}),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=30, ignore_eos=True, allowed_token_ids=letters[:4]),
    ]
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    want = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert "ab" not in got[0].outputs[0].text and "c" not in got[0].outputs[0].text


def test_issue_examples_on_the_default_model():
    llm = LLM(max_model_len=256, kv_cache_memory="64MiB", threads=1)
    bad = [
        dict(max_tokens=2, temperature=1, seed=18446744073709551616),
        dict(max_tokens=2, stop_token_ids=[-(10**20)], min_tokens=1),
        dict(max_tokens=2, stop_token_ids=[-1], min_tokens=1),
        dict(max_tokens=2, temperature=math.nan),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            llm.generate("Hi", SamplingParams(**kw), use_tqdm=False)
    with pytest.raises(ValueError, match="^stop_token_ids contains token id 49152"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[49152]), use_tqdm=False)
    out = llm.generate("Hi", SamplingParams(max_tokens=2, temperature=1, seed=(1 << 63) - 1, n=2), use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]
