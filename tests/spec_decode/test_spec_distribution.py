"""Sampling with speculative decoding keeps the target's distribution: chi-square tests
over many samples of a tiny model with a 32-token vocabulary, with and without drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from stats_helpers import two_sample

from pagedserve import LLM, SamplingParams

VOCAB = 32
N = 1000
PROMPT = [3, 7, 11, 3, 7, 11, 3, 7, 11, 3, 7]  # repetitive: n-gram lookup drafts often
MAX_TOKENS = 4


def _checkpoint(path: Path, seed: int) -> Path:
    """A random Llama with a 32-token word-level vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "t2", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=128,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab32")
    return _checkpoint(root / "target", 0), _checkpoint(root / "draft", 5)


def _samples(target: Path, params: SamplingParams, spec: dict | None) -> tuple[list[tuple[int, ...]], LLM]:
    llm = LLM(
        model=str(target),
        dtype="float32",
        kv_cache_memory="64MiB",
        block_size=8,
        seed=11,
        threads=1,
        speculative_config=spec,
    )
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        pytest.param(
            SamplingParams(
                temperature=0.7, top_k=12, top_p=0.9, repetition_penalty=1.3, max_tokens=MAX_TOKENS, ignore_eos=True
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["plain", "shaped"],
)
def test_token_distribution_unchanged(models, params):
    target, draft = models
    want, _ = _samples(target, params, None)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    ):
        got, llm = _samples(target, params, spec)
        stats = llm.llm_engine.stats()
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
        # Tokens after the first come (partly) from verified drafts.
        for pos in range(1, MAX_TOKENS):
            assert two_sample([s[pos] for s in got], [s[pos] for s in want]) > 1e-3, (spec["method"], pos)
        # The joint of two drafted positions (pairs, rare ones pooled).
        assert two_sample([s[1:3] for s in got], [s[1:3] for s in want]) > 1e-3, spec["method"]


def test_seeded_sampling_is_reproducible(models):
    target, _ = models
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    llm = LLM(
        model=str(target),
        dtype="float32",
        kv_cache_memory="64MiB",
        block_size=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    a = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    b = (
        llm.generate([PROMPT, PROMPT[:5]], [params, SamplingParams(temperature=1.0, max_tokens=12)], use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert a == b
