"""An fp8 or int8 KV cache under tensor and pipeline parallelism (mp executor, gloo on CPU): each
rank sizes and allocates its own 8-bit cache, and greedy tokens equal one process with
the same cache dtype, on a tiny random float32 checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

BASE = dict(dtype="float32", kv_cache_memory="4MiB")


def tokens(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("cd,kv_dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_tp2_and_pp2_with_an_8bit_cache_match_one_process(tiny_checkpoint_factory, cd, kv_dtype):
    path = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2, num_layers=3)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (3, 17, 40)]
    one = LLM(model=str(path), **BASE, kv_cache_dtype=cd)
    expected = tokens(one, prompts)
    one_blocks = one.llm_engine.executor.num_blocks
    one.shutdown()
    for kw in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        llm = LLM(model=str(path), **BASE, kv_cache_dtype=cd, distributed_executor_backend="mp", **kw)
        try:
            runner = llm.llm_engine.runner
            assert {t.dtype for kv in runner.kv_caches for t in kv} == {kv_dtype}
            # Half the heads (TP) or about half the layers (PP) per rank: more blocks fit.
            assert llm.llm_engine.executor.num_blocks > one_blocks
            assert tokens(llm, prompts) == expected, kw
        finally:
            llm.shutdown()
