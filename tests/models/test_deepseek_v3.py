"""DeepSeek-V3 pieces outside the end-to-end transformers comparison (which lives in
test_models_vs_hf): the sigmoid group router against transformers' own, the config
values refused at load, and the latent cache sizes of V3's published shapes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.deepseek_v3 import route_sigmoid_groups

transformers = pytest.importorskip("transformers")

#: DeepSeek-V3's published config.json, shrunk (its routing and latent keys as published).
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("normalize", [True, False])
def test_router_matches_transformers(normalize):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=normalize,
        routed_scaling_factor=2.5,
    )
    gen = torch.Generator().manual_seed(0)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.5)
    h = torch.randn(50, 32, generator=gen)
    _, want_w, want_ids = router(h)
    bias = router.e_score_correction_bias
    got_w, got_ids = route_sigmoid_groups(h, router.weight.detach(), bias, 4, 4, 2, normalize, 2.5)
    want = torch.zeros(50, 16).scatter_(1, want_ids, want_w.detach())
    got = torch.zeros(50, 16).scatter_(1, got_ids, got_w)
    torch.testing.assert_close(got, want)
    assert ((got.view(50, 4, 4) > 0).any(-1).sum(-1) <= 2).all()  # two of four groups
    # The bias moves the choice but not the weights: without it the choice differs.
    unbiased_w, unbiased_ids = route_sigmoid_groups(h, router.weight.detach(), bias * 0, 4, 4, 2, normalize, 2.5)
    assert not torch.equal(unbiased_ids.sort(-1).values, got_ids.sort(-1).values)


def test_published_v3_config_caches_576_values_per_token():
    cfg = ArchConfig.from_hf(dict(V3))
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 288)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"n_group": 5}, "n_group=5"),
        ({"topk_group": 9}, "topk_group=9"),
        ({"num_experts_per_tok": 9, "topk_group": 4}, "num_experts_per_tok=9"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_hf({**V3, **change})


@pytest.mark.parametrize("engine", [{"kv_cache_dtype": "fp8"}, {"dtype": "bfloat16"}], ids=["fp8-latent", "bf16"])
def test_latent_cache_in_fp8_and_bf16_stays_close_to_transformers(engine, tmp_path):
    """The latent halves stored as 8-bit floats (or the whole model in bf16): the first
    greedy token and its logprob stay close to transformers float32."""
    import math

    from test_models_vs_hf import _prompts, build_checkpoint, hf_reference

    from pagedserve import LLM, SamplingParams

    model = build_checkpoint(tmp_path, "deepseekv3-groups-yarn")
    prompts = _prompts(5)[1:4]
    expected = [hf_reference(model, p, 1) for p in prompts]
    llm = LLM(model=str(tmp_path), kv_cache_memory="16MiB", **{"dtype": "float32", **engine})
    k, _ = llm.llm_engine.runner.kv_caches[0]
    assert tuple(k.shape[2:]) == (1, 12)  # kv_lora_rank 16 + rope 8, in halves
    assert k.dtype == (torch.float8_e4m3fn if "kv_cache_dtype" in engine else torch.bfloat16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert math.isclose(got.logprobs[0][tokens[0]].logprob, logprobs[0], abs_tol=0.05)
