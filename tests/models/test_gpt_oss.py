"""GPT-OSS loading rules: the expert-weight layout conversion against transformers'
interleaved ``gate_up_proj``, MXFP4 dequantized at load for GPT-OSS only, tensor
parallelism refused when the config is read (before any weight loads)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_parallel_fits_model
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.gpt_oss import deinterleave_gate_up

transformers = pytest.importorskip("transformers")


def _hf_config(**extra) -> dict:
    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=3, num_experts_per_tok=2,
        max_position_embeddings=128,
    )  # fmt: skip
    cfg = transformers.GptOssConfig(**{**shape, **extra}).to_dict()
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
    assert arch.tensor_parallel  # tests/models/test_models_quant_tp.py runs it at TP=2


def test_tensor_parallelism_fits_when_the_config_is_read():
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    check_parallel_fits_model(cfg, ArchConfig.from_hf(_hf_config()))
    # MXFP4 experts split along whole 32-value blocks: 2880 values are 90 blocks.
    mx = dict(intermediate_size=2880, quantization_config={"quant_method": "mxfp4"})
    check_parallel_fits_model(cfg, ArchConfig.from_hf(_hf_config(**mx)))
    cfg.parallel.tensor_parallel_size = 4
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split .* MXFP4 experts.*divides 90"):
        check_parallel_fits_model(cfg, ArchConfig.from_hf(_hf_config(**mx)))


def test_mxfp4_is_dequantized_for_gpt_oss_and_refused_by_name_elsewhere():
    """(tests/models/test_gpt_oss_mxfp4.py runs an MXFP4 GPT-OSS checkpoint end to end.)"""
    from types import SimpleNamespace

    from pagedserve.quantization.registry import _from_checkpoint

    qcfg = {"quant_method": "mxfp4"}
    gpt_oss = SimpleNamespace(format="hf", path="x", hf_config=_hf_config(quantization_config=qcfg))
    assert _from_checkpoint(gpt_oss, None) == (None, {})
    llama = SimpleNamespace(
        format="hf", path="x", hf_config={"architectures": ["LlamaForCausalLM"], "quantization_config": qcfg}
    )
    with pytest.raises(ValueError, match="quant_method='mxfp4'"):
        _from_checkpoint(llama, None)


def test_gguf_gpt_oss_is_refused_by_name(tmp_path):
    """llama.cpp's ``gpt-oss`` GGUF architecture is not mapped: refused naming it."""
    gguf = pytest.importorskip("gguf")
    from pagedserve.loader.model_source import open_model

    writer = gguf.GGUFWriter(str(tmp_path / "oss.gguf"), "gpt-oss")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt-oss'"):
        open_model(tmp_path / "oss.gguf")
