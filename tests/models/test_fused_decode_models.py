"""Decode steps through the fused rotary + cache write + attention call against
transformers: a tiny GLM-4 (GPT-J-style interleaved partial rotary, turned into
rotate-half at load) and a tiny Llama, float32, head size 64 (a native kernel size),
greedy tokens and each generated token's logprob."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import native
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 259
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
CASES = {
    "glm4-interleaved-partial-rope": ("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}
MAX_NEW = [7, 12, 9]


def _build(path, case: str):
    config_cls, model_cls, extra = CASES[case]
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # wider weights spread the logits: no near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.inference_mode()
def _hf_reference(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_new):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        ids.append(tok)
    return tokens, logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_matches_transformers(case, tmp_path, cpu_kernels):
    model = _build(tmp_path / case, case)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 17, 30)]
    llm = LLM(model=str(tmp_path / case), dtype="float32", kv_cache_memory="16MiB", block_size=8)
    assert llm.llm_engine.ops.source("rotary_paged_attention").endswith("+fused-decode")
    before = native.OP_CALLS.get("rotary_paged_attention:native", 0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Every layer of every decode step after the first token went through the fused call.
    assert native.OP_CALLS.get("rotary_paged_attention:native", 0) - before >= 2 * (max(MAX_NEW) - 1)
    for i, (out, prompt, n) in enumerate(zip(outs, prompts, MAX_NEW)):
        tokens, logprobs = _hf_reference(model, prompt, n)
        got = out.outputs[0]
        assert got.token_ids == tokens, i
        for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j)
