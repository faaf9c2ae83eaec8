"""A handed-off prefix (the disaggregated prefill/decode path, ``import_prefix_kv``)
adopted into a pool whose free blocks are cached prefixes: the evicted blocks spill to
the host tier with their own KV, copied before the adopted blocks overwrite them."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

BLOCK = 16


def test_adopted_blocks_do_not_overwrite_the_kv_their_eviction_spills(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2)
    rng = random.Random(7)
    a = [rng.randrange(3, 250) for _ in range(3 * BLOCK + 1)]  # three full blocks + its last token
    b = [rng.randrange(3, 250) for _ in range(8 * BLOCK + 1)]  # eight full blocks: the whole pool
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)

    src = LLM(model=str(path), enable_prefix_caching=True, block_size=BLOCK)
    src.generate([{"prompt_token_ids": b}], SamplingParams(max_tokens=1), use_tqdm=False)
    kv_b = src.llm_engine.export_prefix_kv(b)
    assert kv_b.shape[2] == 8
    src.shutdown()

    dst = LLM(
        model=str(path),
        enable_prefix_caching=True,
        block_size=BLOCK,
        num_gpu_blocks_override=8,
        kv_offload_memory="4MiB",
        max_model_len=128,
    )
    try:
        kv = dst.llm_engine.kv
        first = dst.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0].outputs[0]
        # A's three blocks are cached and unreferenced; adopting B's eight evicts them all.
        assert dst.llm_engine.import_prefix_kv(b, kv_b) == 8
        assert kv.num_spilled_blocks >= 3
        # The adopted blocks hold B's KV: exported again, they are what was handed over.
        assert dst.llm_engine.export_prefix_kv(b).equal(kv_b)
        hits = kv.host_prefix_hits
        again = dst.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0].outputs[0]
        assert kv.host_prefix_hits - hits == 3 * BLOCK, "A's blocks were not reloaded from the host tier"
        assert again.token_ids == first.token_ids
        for g, w in zip(again.logprobs, first.logprobs, strict=True):
            assert g.keys() == w.keys()
            for t in w:
                assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)
    finally:
        dst.shutdown()
