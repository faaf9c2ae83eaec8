"""ModelSpec against published parameter counts and against transformers' own models."""

from __future__ import annotations

import pytest
from conftest import LLAMA3_8B, LLAMA3_70B, MIXTRAL

from pagedserve.simulate.model_spec import UNMODELED_ARCHITECTURES, ModelSpec, load_model_config


def _architectures() -> list[str]:
    from pagedserve.models import supported_architectures

    return list(supported_architectures())


@pytest.mark.parametrize("cfg,billions", [(LLAMA3_8B, 8.03), (LLAMA3_70B, 70.55)])
def test_llama3_parameter_counts(cfg, billions):
    # Meta's model cards: 8.03B and 70.6B parameters (norms, < 0.01%, not counted here).
    spec = ModelSpec.from_config(cfg)
    assert spec.total_params / 1e9 == pytest.approx(billions, rel=0.003)
    assert spec.kv_bytes_per_token(2) == 2 * cfg["num_hidden_layers"] * 8 * 128 * 2  # GQA: 8 KV heads


def test_mixtral_active_and_total():
    # Mistral's announcement: 46.7B total, 12.9B active per token.
    spec = ModelSpec.from_config(MIXTRAL)
    assert spec.total_params / 1e9 == pytest.approx(46.7, rel=0.01)
    active = spec.layer_params_active + 2 * spec.embedding_params
    assert active / 1e9 == pytest.approx(12.9, rel=0.01)
    assert spec.layer_params_read(1) < spec.layer_params_read(64) <= spec.layer_params_total
    assert spec.layer_params_read(4096) == pytest.approx(spec.layer_params_total, rel=1e-6)


def test_default_model_shipped_config():
    spec = ModelSpec.from_config(load_model_config(None))
    assert spec.tie_word_embeddings and spec.weight_format == "q4_1"
    assert spec.total_params / 1e6 == pytest.approx(134.5, rel=0.01)  # SmolLM2-135M


def test_head_dim_and_text_config():
    # Mistral-NeMo: head_dim 128 although hidden 5120 / 32 heads = 160.
    cfg = {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 131072,
    }
    spec = ModelSpec.from_config({"text_config": cfg, "architectures": ["X"]})
    assert spec.head_dim == 128
    assert spec.attn_params == 5120 * 32 * 128 * 2 + 5120 * 8 * 128 * 2


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.from_config({"vocab_size": 10})


@pytest.mark.parametrize("arch", _architectures() + ["MixtralForCausalLM"])
def test_matches_transformers_parameter_count(arch):
    """Weights (parameters of 2 or more dimensions) of the transformers model built from the same tiny config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, arch, None)
    if cls is None:
        pytest.skip(f"transformers has no {arch}")
    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=arch.startswith("Qwen2"),
        pad_token_id=0,
    )
    if arch == "MixtralForCausalLM":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    config = cls.config_class(**kw)
    with torch.device("meta"):
        model = cls(config)
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # experts may be 3-D
    cfg = config.to_dict()
    cfg["architectures"] = [arch]
    if arch in UNMODELED_ARCHITECTURES:  # refused by name rather than priced wrong
        with pytest.raises(ValueError, match=f"cannot model {arch}"):
            ModelSpec.from_config(cfg)
        return
    assert ModelSpec.from_config(cfg).total_params == weights


def test_gguf_metadata_matches_shipped_config():
    from pagedserve.loader.model_path import resolve_model_path

    path = resolve_model_path(None)
    from_gguf = ModelSpec.from_config(load_model_config(str(path)), name="smollm2-135m-instruct")
    assert from_gguf == ModelSpec.from_config(load_model_config(None), name="smollm2-135m-instruct")
