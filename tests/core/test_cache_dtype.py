"""cache_dtype: the KV cache is kept in the model's dtype, so anything else is refused.

Until an fp8 KV cache exists, ``cache_dtype`` may only be "auto" or the name of the dtype
the model runs in; a value that would silently change nothing must be an error instead.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine import LLMEngine
from pagedserve.testing import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("cache-dtype-model"), writer="safetensors")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8", "float64"])
def test_config_refuses_cache_only_dtypes(name):
    with pytest.raises(ValueError, match="cache_dtype=.*no fp8 KV cache"):
        CacheConfig(cache_dtype=name)


@pytest.mark.parametrize("name", ["auto", "float32", "bfloat16", "float16"])
def test_config_accepts_auto_and_model_dtype_names(name):
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
