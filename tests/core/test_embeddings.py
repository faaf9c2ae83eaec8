"""Embeddings (LLM.embed) equal transformers' final-norm hidden states, pooled and
normalised, on a tiny random float32 checkpoint: last/mean/cls pooling, chunked
prefill, prefix caching; no KV block is kept after a request."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from hf_reference import load_hf

from pagedserve import LLM, PoolingParams
from pagedserve.pooling import pooling_from_checkpoint

SHAPE = dict(arch="llama", num_heads=4, num_kv_heads=2)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 19, 37)]
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 11)]


@torch.inference_mode()
def _hf_embedding(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    return path, load_hf(path)


ENGINES = {
    "chunked+prefix": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
    "one-step": dict(max_num_batched_tokens=2048, enable_prefix_caching=False),
}


@pytest.mark.compat("pooling", "single")
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_embed_matches_transformers(tiny, pooling, engine):
    path, hf = tiny
    prompts = _prompts(259)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", pooling=pooling, **ENGINES[engine])
    for _ in range(2):  # the second round may hit the prefix cache (last pooling)
        outs = llm.embed(prompts)
        for ids, out in zip(prompts, outs):
            assert out.prompt_token_ids == ids and out.finished
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == (hf.config.hidden_size,)
            torch.testing.assert_close(got, _hf_embedding(hf, ids, pooling), rtol=1e-5, atol=1e-5)
        eng = llm.llm_engine
        assert eng.kv.pool.num_in_use == 0 and not eng.has_unfinished_requests()
        eng.kv.pool.check_invariants()
    if engine == "chunked+prefix":
        # mean/cls must compute every position: only last pooling may use cached blocks.
        assert (eng.kv.prefix_hits > 0) == (pooling == "last")


def test_embed_unnormalized_and_mixed_with_generation(tiny):
    from pagedserve import SamplingParams

    path, hf = tiny
    prompts = _prompts(259)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", pooling="mean", max_num_batched_tokens=16)
    eng = llm.llm_engine
    # Generation and embedding requests share steps.
    eng.add_request("g", prompts[3], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("e", prompts[2], pooling_params=PoolingParams(normalize=False))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert len(done["g"].outputs[0].token_ids) == 5
    torch.testing.assert_close(
        torch.tensor(done["e"].outputs.embedding),
        _hf_embedding(hf, prompts[2], "mean", normalize=False),
        rtol=1e-5,
        atol=1e-5,
    )
    assert eng.kv.pool.num_in_use == 0


def test_embed_bad_input(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="dimensions=8"):
        llm.embed([[5, 6]], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    assert (
        len(llm.embed([[5, 6]], PoolingParams(dimensions=hf.config.hidden_size))[0].outputs.embedding)
        == hf.config.hidden_size
    )
    with pytest.raises(ValueError, match="pooling"):
        LLM(model=str(path), pooling="max")


def test_pooling_from_sentence_transformers_config(tiny, tmp_path):
    path, hf = tiny
    st = tmp_path / "st"
    shutil.copytree(path, st)
    assert pooling_from_checkpoint(st) is None
    (st / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hf.config.hidden_size,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": False,
            }
        )
    )
    assert pooling_from_checkpoint(st) == "mean"
    llm = LLM(model=str(st), dtype="float32", kv_cache_memory="16MiB")
    ids = _prompts(259)[2]
    torch.testing.assert_close(
        torch.tensor(llm.embed([ids])[0].outputs.embedding), _hf_embedding(hf, ids, "mean"), rtol=1e-5, atol=1e-5
    )
    # The setting wins over the checkpoint.
    assert LLM(model=str(st), dtype="float32", kv_cache_memory="16MiB", pooling="cls").llm_engine.pooling == "cls"
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        pooling_from_checkpoint(st)


def test_mean_pooling_restarts_after_recompute():
    from pagedserve.pooling import PooledPart, PoolingState

    state = PoolingState("mean")
    state.add(PooledPart(torch.tensor([1.0, 2.0]), 1, 0))
    state.add(PooledPart(torch.tensor([3.0, 4.0]), 1, 1))
    # Preempted by recompute: the prompt runs again from position 0.
    state.add(PooledPart(torch.tensor([10.0, 20.0]), 1, 0))
    state.add(PooledPart(torch.tensor([30.0, 40.0]), 1, 1))
    assert state.result(normalize=False) == [20.0, 30.0]
