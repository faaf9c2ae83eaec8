"""The default model (SmolLM2-135M-Instruct): greedy output with n-gram lookup and with
self-speculation (its GGUF blocks drafting for its float weights) equals greedy output
without speculation."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nRepeat after me: the quick brown fox jumps over the lazy dog.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(kv_cache_memory="128MiB", max_model_len=512, threads=1)


@pytest.fixture(scope="module")
def expected():
    llm = LLM(quantization="none", **KW)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.compat("spec_self_quantized", "single")
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "self_quantized", "num_speculative_tokens": 3},
    ],
)
def test_default_model_greedy_equal(spec, expected):
    # self_quantized runs the target with float weights (quantization unset means none).
    extra = {"quantization": "none"} if spec["method"] == "ngram" else {}
    llm = LLM(speculative_config=spec, **KW, **extra)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if spec["method"] == "self_quantized":
        # The quantized copy agrees with the float model most of the time.
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 2
    assert llm.llm_engine.kv.pool.num_in_use == 0
