"""Hugging Face checkpoint folders written by transformers' save_pretrained."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch

from pagedserve.loader import open_model
from pagedserve.loader.hf_checkpoint import normalize_hf_config


def _save(model: Any, folder: pathlib.Path, tokenizer_dir: pathlib.Path, **kwargs: Any) -> pathlib.Path:
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def _assert_same_weights(folder: pathlib.Path, model: Any) -> dict[str, torch.Tensor]:
    source = open_model(str(folder))
    ours = dict(source.weights())
    reference = model.state_dict()
    if model.config.tie_word_embeddings:
        # save_pretrained stores a tied head once, under the embedding's name.
        assert "lm_head.weight" not in ours
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype, name
        assert torch.equal(tensor, reference[name]), name
    return ours


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_single_file_checkpoint(
    family: str, request: pytest.FixtureRequest, tmp_path: pathlib.Path, saved_tokenizer_dir: pathlib.Path
) -> None:
    model, shape = request.getfixturevalue(family)
    folder = _save(model, tmp_path / family, saved_tokenizer_dir)
    assert (folder / "model.safetensors").is_file()
    _assert_same_weights(folder, model)

    source = open_model(folder)
    config = source.hf_config
    assert source.format == "hf" and source.path == folder.resolve()
    assert config["architectures"] == [type(model).__name__]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert config[key] == shape[key], key
    assert config["head_dim"] == shape["hidden_size"] // shape["num_attention_heads"]
    assert config["rope_theta"] == shape["rope_theta"] and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert config["torch_dtype"] == "float32"
    if family == "tiny_qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in dict(source.weights())


def test_sharded_checkpoint(tiny_llama: Any, tmp_path: pathlib.Path, saved_tokenizer_dir: pathlib.Path) -> None:
    model, _ = tiny_llama
    folder = _save(model, tmp_path / "sharded", saved_tokenizer_dir, max_shard_size="400KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    # A stray safetensors file outside the index must not be read.
    torch.save({}, folder / "unrelated.pt")
    from safetensors.torch import save_file

    save_file({"junk": torch.zeros(1)}, str(folder / "optimizer.safetensors"))
    ours = _assert_same_weights(folder, model)
    assert "junk" not in ours


def test_bfloat16_weights_keep_their_dtype(
    tiny_llama: Any, tmp_path: pathlib.Path, saved_tokenizer_dir: pathlib.Path
) -> None:
    model, _ = tiny_llama
    half = type(model)(model.config).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    folder = _save(half, tmp_path / "bf16", saved_tokenizer_dir)
    _assert_same_weights(folder, half)
    assert open_model(folder).hf_config["torch_dtype"] == "bfloat16"


def test_tokenizer_and_eos_ids(tiny_llama: Any, tmp_path: pathlib.Path, saved_tokenizer_dir: pathlib.Path) -> None:
    model, _ = tiny_llama
    folder = _save(model, tmp_path / "tok", saved_tokenizer_dir)
    source = open_model(folder)
    tokenizer = source.tokenizer()
    assert tokenizer.encode("<|im_start|>hi") == [1, 6004]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    # generation_config.json (saved from the model config) gives the eos id.
    assert source.eos_token_ids == [model.config.eos_token_id]
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 0]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    assert open_model(folder).eos_token_ids == [2, 0]
    (folder / "generation_config.json").unlink()
    assert open_model(folder).eos_token_ids == [model.config.eos_token_id]


def test_config_normalization_of_older_spellings() -> None:
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
    }
    config = normalize_hf_config(legacy, weight_names={"model.embed_tokens.weight"})
    assert config["num_key_value_heads"] == 4 and config["head_dim"] == 16
    assert config["rope_scaling"] == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert config["tie_word_embeddings"] is True  # no lm_head.weight stored
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 500000.0

    modern = {
        **legacy,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0},
        "dtype": "float16",
        "tie_word_embeddings": False,
    }
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        del modern[key]
    config = normalize_hf_config(modern)
    assert config["rope_theta"] == 1e6 and config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert config["torch_dtype"] == "float16" and config["tie_word_embeddings"] is False

    with pytest.raises(ValueError, match="hidden_size"):
        normalize_hf_config({"model_type": "bert"})
