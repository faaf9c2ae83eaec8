"""Fixtures for the capacity planner: config files and a fast tiny profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: Llama-3-70B's published config.json shape (meta-llama/Meta-Llama-3-70B).
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
}
#: Llama-3-8B (meta-llama/Meta-Llama-3-8B).
LLAMA3_8B = {
    **LLAMA3_70B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
#: Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1).
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def write_config(tmp_path: Path):
    def write(cfg: dict, name: str = "model") -> Path:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    return write


@pytest.fixture
def profile_file(tmp_path: Path):
    """A small, slow device so that tiny workloads still queue and preempt."""

    def write(**overrides) -> Path:
        data = {
            "name": "test-device",
            "memory_bytes": 8e9,
            "memory_bandwidth": 100e9,
            "peak_flops": {"bfloat16": 10e12, "float32": 5e12},
            "interconnect_bandwidth": 50e9,
            "host_bandwidth": 20e9,
            "efficiency": {"matmul": 0.5, "memory": 0.8},
            "step_overhead_s": 0.001,
            "per_seq_overhead_s": 1e-5,
        }
        data.update(overrides)
        path = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(data))
        return path

    return write
