"""The model registry: public names, lookups, errors, and the generated docs table."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

import pagedserve.models as models
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.registry import gguf_architectures, resolve_model_class

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_models_table", ROOT / "docs" / "gen_models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_supported_architectures_is_public_and_sorted():
    archs = models.supported_architectures()
    assert "supported_architectures" in models.__all__
    assert archs == sorted(archs) and {"LlamaForCausalLM", "Qwen2ForCausalLM"} <= set(archs)


def test_every_entry_resolves_to_a_model_class():
    for entry in models.model_entries():
        cls = resolve_model_class(entry.architecture)
        for hook in ("layer_weight_names", "finish_layer", "layer_forward", "check_config"):
            assert callable(getattr(cls, hook)), (entry.architecture, hook)
        assert cls.tensor_parallel == entry.tensor_parallel, entry.architecture


def test_gguf_names_agree_with_the_loader():
    from pagedserve.loader.gguf_checkpoint import SUPPORTED_GGUF_ARCHITECTURES

    assert gguf_architectures() == SUPPORTED_GGUF_ARCHITECTURES
    for _, arch in gguf_architectures().values():
        assert arch in models.supported_architectures()


def test_unsupported_architecture_lists_the_supported_ones():
    cfg = {
        "architectures": ["FancyNewForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
    }
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as err:
        ArchConfig.from_hf(cfg)
    for arch in models.supported_architectures():
        assert arch in str(err.value)


def test_docs_table_matches_the_registry():
    gen = _load_generator()
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    assert gen.updated(text) == text, "docs/models.md is stale: run python docs/gen_models_table.py"
    for arch in models.supported_architectures():
        assert f"| `{arch}` |" in text


def test_docs_check_detects_a_stale_table():
    gen = _load_generator()
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    stale = text.replace("| `LlamaForCausalLM` |", "| `LlamaForCausalLMX` |")
    assert gen.updated(stale) != stale


def _cfg(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
        **extra,
    }


@pytest.mark.parametrize("rope_type", ["made-up", "ntk-by-parts"])
def test_unsupported_rope_scaling_fails_at_load_naming_it(rope_type):
    with pytest.raises(ValueError, match=f"rope_scaling type '{rope_type}' is not supported"):
        ArchConfig.from_hf(_cfg(rope_scaling={"rope_type": rope_type, "factor": 2.0}))


def test_unknown_layer_type_fails_at_load_naming_it():
    with pytest.raises(ValueError, match="chunked_attention"):
        ArchConfig.from_hf(_cfg(layer_types=["full_attention", "chunked_attention"]))


def test_window_reading_follows_transformers():
    from pagedserve.models.layers import layer_windows

    assert layer_windows({"sliding_window": 4}, 2) == [4, 4]  # Mistral: every layer
    assert layer_windows({"sliding_window": 4, "use_sliding_window": False}, 2) == [None, None]
    assert layer_windows({"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}, 2) == [None, 4]
    assert layer_windows({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, 2) == [4, None]
    assert layer_windows({"sliding_window": 64, "max_position_embeddings": 64}, 1) == [None]  # never slides
