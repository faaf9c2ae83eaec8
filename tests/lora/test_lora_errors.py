"""Bad adapters fail at load time with a ValueError naming the file and field; the
engine keeps serving the base model and good adapters.  Also the prefix-cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve import LLM, SamplingParams
from pagedserve.config import LoRAConfig
from pagedserve.kv_cache.block_hash import block_hashes
from pagedserve.lora import LoRARequest, lora_cache_salt

HIDDEN, Q = 64, 64  # tests/conftest.py's tiny Llama


def write_adapter(
    path: Path,
    r: int = 4,
    targets=("q_proj",),
    shape_in: int = HIDDEN,
    config: dict | None = None,
    layer: int = 0,
    extra_key: str | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets), **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    tensors = {
        f"{pre}.lora_A.weight": torch.randn(r, shape_in, generator=g),
        f"{pre}.lora_B.weight": torch.randn(Q, r, generator=g),
    }
    if extra_key:
        tensors[extra_key] = torch.randn(2, 2, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(
        model=str(tiny_llama),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_memory="8MiB",
        max_model_len=128,
    )


def bad_cases(root: Path):
    yield write_adapter(root / "rank", r=16), "adapter_config.json: LoRA rank r=16 exceeds max_lora_rank=8"
    yield write_adapter(root / "target", targets=("q_proj", "lm_head")), "target_modules ['lm_head']"
    yield write_adapter(root / "shape", shape_in=96), "an adapter for another base model"
    yield write_adapter(root / "layer", layer=5), "the base model has 2 layers"
    yield write_adapter(root / "key", extra_key="base_model.model.lm_head.lora_A.weight"), "lm_head"
    yield write_adapter(root / "dora", config={"use_dora": True}), "use_dora=True is not supported"
    yield root / "missing", "is not a directory"
    nofile = write_adapter(root / "nofile")
    (nofile / "adapter_model.safetensors").unlink()
    yield nofile, "has no adapter_model.safetensors"
    broken = write_adapter(root / "broken")
    (broken / "adapter_config.json").write_text("{")
    yield broken, "adapter_config.json: not valid JSON"


def test_bad_adapters_are_refused_and_engine_keeps_serving(llm, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = LoRARequest("good", 1, str(write_adapter(tmp_path / "good")))
    before = llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=good)[0].outputs[0].token_ids
    for i, (path, message) in enumerate(bad_cases(tmp_path)):
        with pytest.raises(ValueError, match=None) as info:
            llm.generate(
                [[5, 6, 7], [8, 9]],
                params,
                use_tqdm=False,
                lora_request=[good, LoRARequest(f"bad{i}", 10 + i, str(path))],
            )
        assert message in str(info.value), str(info.value)
        assert not llm.llm_engine.has_unfinished_requests()  # nothing queued
    after = llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=good)[0].outputs[0].token_ids
    assert after == before
    assert llm.llm_engine.kv.pool.num_in_use == 0


def test_request_shape_errors(llm, tiny_llama):
    with pytest.raises(ValueError, match="2 prompts but 1 lora_request"):
        llm.generate([[1, 2], [3]], use_tqdm=False, lora_request=[None])
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="max_lora_rank must be in"):
        LoRAConfig(max_lora_rank=128)


def test_lora_needs_enable_lora(tiny_llama, tmp_path):
    base = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        base.generate([[1, 2]], use_tqdm=False, lora_request=LoRARequest("a", 1, str(write_adapter(tmp_path / "a"))))


def test_lora_composes_with_every_deployment_setting():
    """No config rule refuses adapters with parallelism, device maps, weight offload or
    speculative decoding (each combination is tested against peft or one process in
    test_lora_placement.py and tests/distributed/test_dist_lora.py)."""
    from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SpeculativeDecodingConfig

    lora = LoRAConfig(enable_lora=True)
    EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), lora=lora)
    EngineConfig(device=DeviceConfig(device_map="cpu:1,cpu"), lora=lora)
    EngineConfig(cache=CacheConfig(cpu_offload_gb=1.0), lora=lora)
    EngineConfig(speculative=SpeculativeDecodingConfig({"method": "ngram", "num_speculative_tokens": 2}), lora=lora)


def test_prefix_hash_keyed_by_adapter():
    tokens = list(range(64))
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    chains = [block_hashes(tokens, 16, 4, lora_cache_salt(salt, lora)) for salt in (None, "s") for lora in (None, a, b)]
    assert len({c[-1][0] for c in chains}) == 6  # every (salt, adapter) pair its own chain
    assert lora_cache_salt("s", None) == "s" and lora_cache_salt(None, None) is None
