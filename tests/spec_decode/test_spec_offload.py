"""Speculative decoding with the one-process memory features gives the greedy tokens (and
logprobs) of the engine without speculation, for n-gram lookup, a draft model and an int8
self-quantized copy:

- ``kv_offload_memory`` (host KV tier) with swap preemption: drafted tokens are scheduled
  like prompt tokens but never registered in the prefix cache (only verified tokens are
  hashed), so no block holding a draft spills to host; rejected drafts' slots are trimmed
  after each step, and a preempted request drops its drafts before its verified blocks
  swap out; the second round reloads spilled prefixes from host;
- ``cpu_offload_gb``: the verification forward streams the offloaded layers like any other;
- ``device_map``: the verification rows' logits are on the last segment's device and are
  verified with its ops (here the ``cpu-hm`` test platform of
  tests/offload/test_offload_device_map.py, whose KV layout differs from the CPU's).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))
from test_offload_device_map import plugin  # noqa: E402,F401 (the cpu-hm platform, installed per module)

PROMPTS = [
    [5, 77, 120, 33, 9, 200, 41, 5, 77, 120, 33, 9, 200, 41, 5, 77, 120],
    [9, 9, 9, 9, 9, 9],
    list(range(10, 40)) + list(range(10, 20)),
    [31, 4, 31, 4, 31, 4, 31, 4, 100, 101, 102, 31, 4, 100],
]
# 11 blocks of 8 tokens cannot hold eight sequences of up to ~56 tokens: preemptions.
ENGINE = dict(dtype="float32", max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=11, max_model_len=88)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, logprobs=1)
OFFLOAD = {
    "kv_offload": dict(kv_offload_memory="1MiB", preemption_mode="swap"),
    "cpu_offload": dict(cpu_offload_gb=0.001),  # both layers of the tiny model (~0.2 MB each)
    "device_map": dict(device_map="cpu:1,cpu-hm"),  # the LM head on cpu-hm
}
# Every proposer under every mode above (the matrix reads these literals).
COMPAT_FEATURES = ("spec_ngram", "spec_draft_model", "spec_self_quantized")
COMPAT_DEPLOYMENTS = ("kv_offload", "cpu_offload", "device_map")


@pytest.fixture(scope="module")
def target(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(seed=0)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target with noise on every matrix: verification both accepts and rejects."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("noisy-draft")
    shutil.copytree(target, path, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(path / "model.safetensors"))
    noisy = {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(noisy, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _generate(llm: LLM) -> list:
    """Two rounds of PROMPTS (the second hits the prefix cache, or the host tier)."""
    return [llm.generate(PROMPTS, PARAMS, use_tqdm=False) for _ in range(2)]


@pytest.fixture(scope="module")
def expected(target):
    return _generate(LLM(model=str(target), device="cpu", **ENGINE))


def _spec(method: str, draft) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "self_quantized":  # the tiny float checkpoint has no GGUF blocks: its int8 copy drafts
        return {"method": "self_quantized", "num_speculative_tokens": 3, "quantization": "int8"}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


def _cells():
    for method in ("ngram", "draft_model", "self_quantized"):
        for mode in OFFLOAD:
            yield pytest.param(method, mode, id=f"{method}-{mode}")


@pytest.mark.parametrize("method, mode", list(_cells()))
def test_greedy_equal_with_offload(method, mode, plugin, target, draft, expected):  # noqa: F811 (fixture)
    llm = LLM(model=str(target), speculative_config=_spec(method, draft), **ENGINE, **OFFLOAD[mode])
    got = _generate(llm)
    for got_round, want_round in zip(got, expected, strict=True):
        for g, w in zip(got_round, want_round, strict=True):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            for gc, wc in zip(g.outputs, w.outputs):
                for tok, lp, wlp in zip(gc.token_ids, gc.logprobs, wc.logprobs, strict=True):
                    assert set(lp) == set(wlp)
                    assert lp[tok].logprob == pytest.approx(wlp[tok].logprob, abs=1e-4)
    eng = llm.llm_engine
    stats = eng.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if method != "self_quantized":  # the int8 copy agrees with the tiny float model everywhere
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0
    if mode == "kv_offload":
        kv = eng.kv
        assert kv.num_swap_outs > 0 and kv.num_swapped_in_tokens > 0
        assert kv.num_reloaded_tokens > 0  # the second round's prefixes came back from host
        kv.check_invariants()
        assert all(b.ref_cnt == 0 for b in kv.host.blocks)
    elif mode == "cpu_offload":
        assert eng.weight_streamer.offloaded == [0, 1] and eng.weight_streamer.num_layer_copies > 0
    else:
        assert [p.name for p in eng.runner.layer_platforms] == ["cpu", "cpu-hm"]
        assert plugin.CALLS["paged_attention"] > 0
    eng.kv.pool.check_invariants()
    assert eng.kv.pool.num_in_use == 0
    if method != "ngram":
        assert eng.spec.proposer.kv.pool.num_in_use == 0
