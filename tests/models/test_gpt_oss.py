"""GPT-OSS loading rules: the expert-weight layout conversion against transformers'
interleaved ``gate_up_proj``, MXFP4 checkpoints refused by name at load, tensor
parallelism refused when the config is read (before any weight loads)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_parallel_fits_model
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.gpt_oss import deinterleave_gate_up

transformers = pytest.importorskip("transformers")


def _hf_config(**extra) -> dict:
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=3, num_experts_per_tok=2,
        max_position_embeddings=128, **extra,
    ).to_dict()  # fmt: skip
    return {**cfg, "architectures": ["GptOssForCausalLM"]}


def test_deinterleave_puts_gate_rows_then_up_rows():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 5, 8, generator=gen)  # [E, hidden, 2I], I = 4
    bias = torch.randn(3, 8, generator=gen)
    w13, b13 = deinterleave_gate_up(gate_up, bias)
    x = torch.randn(2, 5, generator=gen)
    for e in range(3):
        h = x @ gate_up[e] + bias[e]  # transformers: gate = h[..., ::2], up = h[..., 1::2]
        got = x @ w13[e].T + b13[e]
        torch.testing.assert_close(got[:, :4], h[:, ::2])
        torch.testing.assert_close(got[:, 4:], h[:, 1::2])


def test_layer_types_give_alternating_windows():
    from pagedserve.models.layers import layer_windows

    arch = ArchConfig.from_hf(_hf_config())
    assert layer_windows(arch.hf_config, arch.num_layers) == [4, None]
    assert not arch.tensor_parallel


def test_tensor_parallelism_is_refused_when_the_config_is_read():
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="GptOssForCausalLM does not support tensor parallelism"):
        check_parallel_fits_model(cfg, ArchConfig.from_hf(_hf_config()))


def test_mxfp4_checkpoint_is_refused_naming_it(tmp_path):
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    cfg = _hf_config(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_byte_tokenizer(tmp_path)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**_hf_config(), "vocab_size": 259}))
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg["vocab_size"] = 259
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mxfp4"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")
