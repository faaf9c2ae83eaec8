"""Speculative decoding for hybrid models (recurrent-state layers beside attention)
against transformers, float32, on the tiny random checkpoints of
test_models_hybrid_vs_hf.py: a Qwen3.5 (Gated DeltaNet) and a Granite 4 (Mamba 2).

A verification step computes a request's drafts through its recurrent layers too; the
state after each draft position is captured and the request keeps the one at its last
accepted token (kv_cache/state_group.py, "Speculative decoding").  The greedy tokens
and logprobs equal transformers' (and the engine's without drafts), with drafts both
accepted and rejected, prefix caching on (a second round hits), chunked prefill,
preemption and ``n=2``; every page is back in the pool afterwards.  What still cannot
work is refused.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_models_hybrid_vs_hf import VOCAB, build_checkpoint, hf_reference

from pagedserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

CASES = ["qwen3_5-deltanet-gated-attn", "granite4-mamba2-moe-nope"]
MAX_NEW = [24, 20, 16]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
#: Checkpoints every 2 blocks of 4 tokens: accepted drafts cross boundaries often.
COMMON = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4, state_checkpoint_interval=2)


def _prompts(seed: int) -> list[list[int]]:
    """Repetitive prompts (n-gram lookup drafts often) of different lengths."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, VOCAB) for _ in range(5)]
    noise = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [motif * 4 + noise[:3], noise[:9] + motif * 2, noise[10:40] + motif + noise[10:20]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            model = build_checkpoint(path, case)
            prompts = _prompts(len(case))
            cache[case] = (path, prompts, [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)])
        return cache[case]

    return get


def _params(n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_NEW]


def _check(outs, expected, what: str) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        for got in out.outputs:
            assert got.token_ids == tokens, f"{what}: prompt {i}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (what, i, j)


def _accepted_and_rejected(llm: LLM, accepted: bool = True) -> None:
    """Drafts were verified, some rejected, and (``accepted``) some accepted."""
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert (0 if accepted else -1) < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


#: The other families (Nemotron-H's Mamba 2, Jamba's Mamba 1, LFM2's short convolutions): slow.
OTHERS = [
    pytest.param(c, marks=pytest.mark.slow)
    for c in ("nemotronh-mamba2-mlp-attn", "jamba-mamba1-moe-attn", "lfm2-shortconv-bias-attn")
]


@pytest.mark.parametrize("case", CASES + OTHERS)
def test_hybrid_ngram_equals_transformers_with_prefix_caching(case, hybrid):
    """Whole prompts and chunks of 7 tokens; the second round hits the checkpoints the
    first wrote (those at boundaries that accepted drafts crossed included)."""
    path, prompts, expected = hybrid(case)
    for budget in (512, 7):
        llm = LLM(model=str(path), max_num_batched_tokens=budget, speculative_config=NGRAM, **COMMON)
        kv = llm.llm_engine.kv
        for round_ in range(2):
            _check(llm.generate(prompts, _params(), use_tqdm=False), expected, f"budget {budget} round {round_}")
            assert kv.pool.num_in_use == 0
            kv.check_invariants()
        # This tiny Nemotron-H's output does not repeat as n-gram lookup guesses: no draft accepted.
        _accepted_and_rejected(llm, accepted=not case.startswith("nemotronh"))
        assert llm.llm_engine.stats().prefix_cache_hits > 0


def test_hybrid_checkpoints_inside_verified_drafts(hybrid):
    """Checkpoints written while decoding with drafts (at boundaries that the known
    token or accepted drafts reached) hold the right state: a prompt made of the first
    prompt and its output hits inside the output and continues as transformers does."""
    path, prompts, expected = hybrid(CASES[0])
    llm = LLM(model=str(path), max_num_batched_tokens=512, speculative_config=NGRAM, **COMMON)
    # The second prompt: its output repeats (4, 237, 4, 237, 4), so n-gram lookup drafts.
    (out,) = llm.generate([prompts[1]], _params()[1:2], use_tqdm=False)
    _check([out], expected[1:2], "first")
    _accepted_and_rejected(llm)
    tokens, logprobs = expected[1]
    follow = prompts[1] + tokens[:-1]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    (again,) = llm.generate([follow], one, use_tqdm=False)
    assert again.num_cached_tokens > len(prompts[1])
    assert again.outputs[0].token_ids == tokens[-1:]
    assert math.isclose(again.outputs[0].logprobs[0][tokens[-1]].logprob, logprobs[-1], abs_tol=2e-4)


@pytest.mark.parametrize("case", CASES)
def test_hybrid_ngram_under_preemption_and_n2(case, hybrid):
    path, prompts, expected = hybrid(case)
    llm = LLM(
        model=str(path),
        max_num_batched_tokens=64,
        num_gpu_blocks_override=96,
        max_model_len=80,
        speculative_config=NGRAM,
        **COMMON,
    )
    outs = llm.generate(prompts, _params(n=2), use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    _check(outs, expected, "preempting n=2")
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_in_use == 0
    _accepted_and_rejected(llm)


def test_hybrid_ngram_under_swap_preemption(hybrid):
    """Preemption by swap (the host KV tier) between verification steps: a request's
    state pages move out and back as its state at its last accepted token."""
    path, prompts, expected = hybrid(CASES[0])
    llm = LLM(
        model=str(path),
        max_num_batched_tokens=64,
        num_gpu_blocks_override=96,
        max_model_len=80,
        preemption_mode="swap",
        kv_offload_memory="4MiB",
        speculative_config=NGRAM,
        **COMMON,
    )
    _check(llm.generate(prompts, _params(n=2), use_tqdm=False), expected, "swapping n=2")
    stats = llm.llm_engine.stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    kv = llm.llm_engine.kv
    assert kv.pool.num_in_use == 0 and kv.host.num_in_use == 0
    kv.check_invariants()
    _accepted_and_rejected(llm)


def test_hybrid_ngram_equals_engine_without_drafts(hybrid):
    """Against the engine's own output without speculation, logprobs of the top 3 too."""
    path, prompts, _ = hybrid(CASES[1])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=3) for m in MAX_NEW]
    base = LLM(model=str(path), max_num_batched_tokens=7, **COMMON).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(path), max_num_batched_tokens=7, speculative_config=NGRAM, **COMMON)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, b in zip(got, base):
        assert g.outputs[0].token_ids == b.outputs[0].token_ids
        for lg, lb in zip(g.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(lg) == set(lb)
            for tok in lb:
                assert lg[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-4)
    _accepted_and_rejected(llm)


def _bigram_draft(path, tokens: list[list[int]]) -> None:
    """A Llama checkpoint in ``path`` whose greedy next token after ``t`` is the token
    that followed ``t`` in ``tokens`` (its layers add nothing to the embedding; its head
    reads the embedding of the last token): it agrees with the target where the target's
    output follows its own bigrams and disagrees elsewhere."""
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(6)
    emb = torch.randn(VOCAB, 64, generator=gen)
    emb = emb / emb.norm(dim=1, keepdim=True)
    head = 0.01 * torch.randn(VOCAB, 64, generator=gen)
    for seq in tokens:
        for a, b in zip(seq, seq[1:]):
            head[b] += emb[a]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)


def test_hybrid_draft_model(hybrid, tmp_path):
    """A (non-hybrid) draft model for a hybrid target: drafts accepted and rejected,
    transformers' tokens and logprobs, prefix caching on."""
    path, prompts, expected = hybrid(CASES[0])
    draft = tmp_path / "draft"
    _bigram_draft(draft, [p + t for p, (t, _) in zip(prompts, expected)])
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(model=str(path), max_num_batched_tokens=7, speculative_config=spec, **COMMON)
    for round_ in range(2):
        _check(llm.generate(prompts, _params(), use_tqdm=False), expected, f"draft model round {round_}")
        assert llm.llm_engine.kv.pool.num_in_use == 0
    _accepted_and_rejected(llm)


def test_hybrid_refuses_drafts_with_a_recurrent_state(hybrid, tmp_path):
    """A draft model with recurrent layers (its own state could not be rewound past the
    rejected drafts), and self-speculation of a hybrid model, are refused before weights load."""
    path, _, _ = hybrid(CASES[0])
    with pytest.raises(ValueError, match="recurrent-state layers") as err:
        LLM(model=str(path), speculative_config={"model": str(path), "num_speculative_tokens": 2}, **COMMON)
    assert "draft model" in str(err.value)
    with pytest.raises(ValueError, match="recurrent-state layers") as err:
        LLM(model=str(path), speculative_config={"method": "self_quantized", "num_speculative_tokens": 2}, **COMMON)
    assert "self_quantized" in str(err.value)
