"""Tensor and pipeline parallelism with the mp executor (gloo on CPU): greedy tokens are
identical to a single process on tiny random float32 checkpoints."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dist_helpers import greedy, make_prompts, running_llm, token_ids

pytestmark = pytest.mark.timeout(90)

SHAPES = {
    # 4 heads / 2 KV heads: both sharded; odd vocab (259): the LM head shard is padded.
    "llama-gqa2": dict(arch="llama", num_heads=4, num_kv_heads=2, num_layers=3),
    # One KV head for two ranks: replicated; biases; tied embeddings (vocab-parallel LM head).
    "qwen2-kv1-tied": dict(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint_factory):
    cache = {}

    def get(shape: str):
        if shape not in cache:
            path = tiny_checkpoint_factory(**SHAPES[shape])
            with running_llm(model=str(path)) as llm:
                cache[shape] = (path, token_ids(llm, make_prompts(), greedy()))
        return cache[shape]

    return get


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_matches_single_process(shape, reference):
    path, expected = reference(shape)
    prompts = make_prompts()
    with running_llm(model=str(path), tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        eng = llm.llm_engine
        # Each rank holds half the heads: its KV blocks are half as big, so more fit.
        assert eng.runner.model.num_heads == 2
        assert token_ids(llm, prompts, greedy()) == expected
        # A second round hits the prefix cache on every rank's shard.
        assert token_ids(llm, prompts[::-1], greedy()) == expected[::-1]
        assert eng.kv.prefix_hits > 0
        assert eng.kv.pool.num_in_use == 0
    assert not dist.is_initialized()


def test_pp2_matches_single_process(reference):
    path, expected = reference("llama-gqa2")
    with running_llm(model=str(path), pipeline_parallel_size=2) as llm:  # mp is the default
        model = llm.llm_engine.runner.model
        assert (model.layer_start, model.layer_end) == (0, 1)  # 3 layers: stage 1 has 2
        assert len(llm.llm_engine.runner.kv_caches) == 1
        assert token_ids(llm, make_prompts(), greedy()) == expected


def test_micro_batches_split_by_tokens():
    from types import SimpleNamespace

    from pagedserve.distributed.worker import split_micro_batches

    out = SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=n) for n in (10, 1, 1, 8)])
    assert split_micro_batches(out, 2) == [[0], [1, 2, 3]]
    assert split_micro_batches(out, 1) == [[0, 1, 2, 3]]
    one = SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=5)])
    assert split_micro_batches(one, 2) == [[0]]


def test_tp_rejects_indivisible_heads(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPES["llama-gqa2"])
    with pytest.raises(Exception, match="tensor_parallel_size=3"):
        with running_llm(model=str(path), tensor_parallel_size=3):
            pass
    assert not dist.is_initialized()
