"""Fixtures for the loader tests: the default model, transformers references, file writers.

transformers is the independent reference throughout; its GGUF and tokenizer loads are slow,
so they are shared across the session (``default_model_hf_dir`` and ``hf_default_tokenizer``
are in tests/conftest.py: other folders' tests use them too).
"""

from __future__ import annotations

import os

# Nothing here may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pagedserve.loader import ModelSource, Tokenizer, open_model
from pagedserve.loader.model_path import default_model_path


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    return default_model_path()


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    return open_model(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_source: ModelSource) -> Tokenizer:
    return default_source.tokenizer()


@pytest.fixture(scope="session")
def saved_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, hf_default_tokenizer: Any) -> pathlib.Path:
    """The default tokenizer written as tokenizer.json + tokenizer_config.json (+ template)."""
    folder = tmp_path_factory.mktemp("default_tokenizer")
    hf_default_tokenizer.save_pretrained(str(folder))
    return folder


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF -> GGUF row order of q/k projections, as llama.cpp's convert_hf_to_gguf.py does it."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.fixture(scope="session")
def llama_cpp_permute() -> Callable[[np.ndarray, int], np.ndarray]:
    return _llama_cpp_permute


GGUFWriterFn = Callable[..., pathlib.Path]


@pytest.fixture(scope="session")
def write_gguf() -> GGUFWriterFn:
    """A function writing a tiny Llama/Qwen2 GGUF from an HF state dict.

    write(path, arch, config, state_dict, types, metadata=None, random_bytes=(), extra_tensors=None)
    where `types` maps HF names to ggml type names (default F32), `metadata` adds key/value
    pairs (a tokenizer), names in `random_bytes` get random block data (for types the gguf
    package can only dequantize) and `extra_tensors` are written as given under GGUF names.
    """
    import gguf

    def write(
        path: pathlib.Path,
        arch: str,
        config: dict[str, Any],
        state_dict: dict[str, torch.Tensor],
        types: dict[str, str],
        metadata: dict[str, Any] | None = None,
        random_bytes: tuple[str, ...] = (),
        extra_tensors: dict[str, tuple[np.ndarray, str]] | None = None,
    ) -> pathlib.Path:
        rng = np.random.default_rng(0)
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_name(f"tiny {arch}")
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_vocab_size(config["vocab_size"])
        if arch == "llama":
            writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
        for key, value in (metadata or {}).items():
            _add_kv(writer, key, value)
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
        for hf_name, tensor in state_dict.items():
            stem, suffix = hf_name.rsplit(".", 1)
            gguf_name = f"{name_map.get_name(stem)}.{suffix}"
            values = tensor.detach().to(torch.float32).numpy()
            if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
                values = _llama_cpp_permute(values, heads)
            qtype = gguf.GGMLQuantizationType[types.get(hf_name, "F32")]
            if hf_name in random_bytes:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                # Bytes below 0x3C keep every embedded float16 scale finite.
                data = rng.integers(0, 0x3C, (values.shape[0], values.shape[1] // block * size), dtype=np.uint8)
            else:
                data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        for gguf_name, (data, type_name) in (extra_tensors or {}).items():
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write


def _add_kv(writer: Any, key: str, value: Any) -> None:
    """One tokenizer metadata entry, with the value type llama.cpp writes for it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # lists: strings, INT32 token types, FLOAT32 scores (element type inferred)
        writer.add_array(key, list(value))


TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,  # K-quant blocks are 256 wide, so rows must be multiples of 256
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _tiny_model(config_class: Any, model_class: Any, **overrides: Any) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(0)
    hf_config = config_class(**{**TINY_SHAPE, **overrides})
    model = model_class(hf_config).eval()
    with torch.no_grad():
        # Random init leaves norms at exactly 1 and biases at 0; make every tensor distinctive.
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    plain = {**TINY_SHAPE, **overrides, "rope_theta": float(hf_config.rope_parameters["rope_theta"])}
    return model, plain


@pytest.fixture(scope="session")
def tiny_llama() -> tuple[Any, dict[str, Any]]:
    """A random 2-layer Llama (GQA 4:2) and its shape as a plain dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny_model(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2() -> tuple[Any, dict[str, Any]]:
    """A random 2-layer Qwen2 (q/k/v biases, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _tiny_model(Qwen2Config, Qwen2ForCausalLM, tie_word_embeddings=True)
