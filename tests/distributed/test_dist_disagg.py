"""Disaggregated prefill/decode: KV blocks computed by a prefill instance in another
process are handed to the decode instance, whose greedy outputs equal one instance's."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dist_helpers import BASE, greedy, make_prompts, running_llm, token_ids

pytestmark = pytest.mark.timeout(90)


@pytest.mark.compat("prefix_caching", "disagg")
def test_disaggregated_matches_single_instance(tiny_checkpoint_factory, monkeypatch):
    from pagedserve.engine import LLMEngine
    from pagedserve.serving.disagg import DisaggregatedLLM

    path = tiny_checkpoint_factory(arch="qwen2", num_heads=4, num_kv_heads=2)
    prompts = make_prompts(5)
    others = [p + [7, 8, 9] for p in prompts if len(p) > 8]  # nothing cached for these yet
    with running_llm(model=str(path)) as llm:
        expected = token_ids(llm, prompts, greedy(10))
        expected_others = token_ids(llm, others, greedy(10))
    dllm = DisaggregatedLLM(model=str(path), prefill_threads=1, **BASE)
    try:
        outs = dllm.generate(prompts, greedy(10))
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Full blocks of every prompt longer than one block came from the prefill side:
        # (6-1)//4 + (17-1)//4 + (30-1)//4 + (15-1)//4 + (22-1)//4 = 1+4+7+3+5 (shared ones once).
        assert dllm.num_injected_blocks >= 1 + 4 + 7 + 3
        eng = dllm.llm.llm_engine
        assert eng.kv.prefix_hits > 0
        assert eng.kv.pool.num_in_use == 0
        # A second batch on the same pair works too.
        again = dllm.generate(prompts[:2], greedy(10))
        assert [o.outputs[0].token_ids for o in again] == expected[:2]

        # The decode side really uses the handed-over KV: zeroing it changes the outputs.
        real_import = LLMEngine.import_prefix_kv
        zeroed = lambda eng, toks, kv, salt=None: real_import(eng, toks, kv * 0, salt)  # noqa: E731
        monkeypatch.setattr(LLMEngine, "import_prefix_kv", zeroed)
        corrupted = dllm.generate(others, greedy(10))
        assert [o.outputs[0].token_ids for o in corrupted] != expected_others
    finally:
        dllm.shutdown()
    assert not dist.is_initialized()
    assert not dllm.proc.is_alive()
