"""How hybrid configs name their layers: ``layer_types`` (Qwen3.5 / Qwen3-Next
``linear_attention``, Granite 4 ``mamba`` / ``attention``, LFM2 ``conv``, Jamba's ``attn_layer_period``), Nemotron-H's
``layers_block_type`` or ``hybrid_override_pattern``, read as each layer's KV cache kind;
Nemotron-H's ``backbone.*`` tensor names and its implied layer count."""

from __future__ import annotations

import pytest

from pagedserve.config_rules import NO_KV_CACHE, RECURRENT_STATE
from pagedserve.loader.hf_checkpoint import canonical_name, normalize_hf_config
from pagedserve.models.layers import block_types, layer_windows

S, N = RECURRENT_STATE, NO_KV_CACHE


def test_layer_types_mark_recurrent_layers():
    qwen = {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "max_position_embeddings": 64}
    assert layer_windows(qwen, 4) == [S, S, S, None]
    granite = {"layer_types": ["mamba", "attention", "mamba"]}
    assert layer_windows(granite, 3) == [S, None, S]
    lfm2 = {"layer_types": ["conv", "full_attention", "conv"]}
    assert layer_windows(lfm2, 3) == [S, None, S]
    jamba = {"attn_layer_period": 4, "attn_layer_offset": 1}  # Jamba writes no per-layer list
    assert layer_windows(jamba, 6) == [S, None, S, S, S, None]
    with pytest.raises(ValueError, match="retention"):
        layer_windows({"layer_types": ["retention"]}, 1)


def test_nemotron_h_mixers():
    assert block_types({"hybrid_override_pattern": "M-M*-"}) == [
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
        "mlp",
    ]
    assert layer_windows({"hybrid_override_pattern": "M-M*-"}, 5) == [S, N, S, None, N]
    assert layer_windows({"layers_block_type": ["mamba", "attention", "mlp"]}, 3) == [S, None, N]
    with pytest.raises(ValueError, match="letters"):
        block_types({"hybrid_override_pattern": "M?"})
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        layer_windows({"layers_block_type": ["mamba", "mlp"]}, 3)


def test_backbone_names_and_layer_count():
    assert canonical_name("backbone.embeddings.weight") == "model.embed_tokens.weight"
    assert canonical_name("backbone.norm_f.weight") == "model.norm.weight"
    assert canonical_name("backbone.layers.3.mixer.A_log") == "model.layers.3.mixer.A_log"
    assert canonical_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    cfg = {"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16, "hybrid_override_pattern": "M*-"}
    cfg["layer_norm_epsilon"] = 1e-5
    out = normalize_hf_config(cfg)
    assert out["num_hidden_layers"] == 3 and out["rms_norm_eps"] == 1e-5
