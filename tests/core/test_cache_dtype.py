"""cache_dtype: the model's dtype, or an 8-bit KV cache the platform declares.

``cache_dtype`` may be "auto", the name of the dtype the model runs in, or fp8_e4m3
(alias fp8) / fp8_e5m2 / int8 where the platform's attention reads them; anything else
(int4, vLLM's fp8_inc, a dtype other than the model's) is an error, never a silent no-op.  A
platform that does not declare a quantized dtype is refused by name before any
weights load.
"""

from __future__ import annotations

import pytest
import torch

import pagedserve.engine.llm_engine as engine_mod
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.testing import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("cache-dtype-model"), writer="safetensors")


@pytest.mark.parametrize("name", ["int4", "float64", "fp4"])
def test_config_refuses_unknown_cache_dtypes(name):
    with pytest.raises(ValueError, match=rf"cache_dtype={name!r} is not supported.*'fp8_e5m2'"):
        CacheConfig(cache_dtype=name)


@pytest.mark.parametrize("name", ["fp8_inc", "fp8_ds_mla"])
def test_config_refuses_vllm_fp8_variants_not_implemented(name):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype={name!r} is not implemented.*'fp8_e4m3'"):
        CacheConfig(cache_dtype=name)


@pytest.mark.parametrize("name", ["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_config_accepts_auto_model_dtype_names_and_8bit(name):
    assert CacheConfig(cache_dtype=name).cache_dtype == name


def _engine(model, cache_dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model), dtype="float32"),
            cache=CacheConfig(cache_dtype=cache_dtype, kv_cache_memory="4MiB"),
        )
    )


def test_engine_refuses_cache_dtype_other_than_model_dtype(tiny_model):
    with pytest.raises(ValueError, match="cache_dtype='bfloat16' differs from the model's dtype float32"):
        _engine(tiny_model, "bfloat16")


def test_engine_accepts_model_dtype_name(tiny_model):
    engine = _engine(tiny_model, "float32")
    try:
        assert engine.runner.kv_caches[0][0].dtype == torch.float32
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "name,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)]
)
def test_engine_allocates_the_8bit_cache(tiny_model, name, dtype):
    engine = _engine(tiny_model, name)
    try:
        assert {t.dtype for kv in engine.runner.kv_caches for t in kv} == {dtype}
    finally:
        engine.shutdown()


def test_platform_without_the_capability_is_refused_before_weights_load(tiny_model, monkeypatch):
    monkeypatch.setattr(CpuPlatform, "kv_cache_dtypes", ("fp8_e5m2",))

    def forbidden(*_a, **_k):
        raise AssertionError("weights started loading before kv_cache_dtype was checked")

    monkeypatch.setattr(engine_mod, "create_executor", forbidden)
    monkeypatch.setattr(engine_mod, "quantize_source", forbidden)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is not supported on platform 'cpu'.*'fp8_e5m2'"):
        _engine(tiny_model, "fp8_e4m3")
