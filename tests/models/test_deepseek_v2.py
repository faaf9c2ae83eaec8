"""DeepSeek-V2 pieces outside the end-to-end transformers comparison (which lives in
test_models_vs_hf): the router against transformers' own, the config values refused at
load, and a config.json as DeepSeek publishes V2-Lite's parsing to the right shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.loader.errors import ModelLoadError
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.deepseek_v2 import DeepseekV2ForCausalLM, route_deepseek

transformers = pytest.importorskip("transformers")

#: The keys and values of DeepSeek-V2-Lite's published config.json, shrunk.
LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 2,
    "n_routed_experts": 8,
    "ep_size": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_router_matches_transformers(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = transformers.DeepseekV2Config(
        hidden_size=32,
        num_attention_heads=4,
        n_routed_experts=12,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    gen = torch.Generator().manual_seed(0)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    h = torch.randn(50, 32, generator=gen)
    _, want_w, want_ids = router(h)
    got_w, got_ids = route_deepseek(h, router.weight.detach(), 3, method, 4, 2, 2.5)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs as sets.
    want = torch.zeros(50, 12).scatter_(1, want_ids, want_w.detach())
    got = torch.zeros(50, 12).scatter_(1, got_ids, got_w)
    torch.testing.assert_close(got, want)
    if method == "group_limited_greedy":  # the choice really is limited to 2 of 4 groups
        assert ((got.view(50, 4, 3) > 0).any(-1).sum(-1) <= 2).all()


def test_published_lite_config_parses():
    cfg = ArchConfig.from_hf(dict(LITE))
    # The latent cache: one vector of kv_lora_rank + rope = 40 per token, in two halves.
    assert cfg.head_dim == 20
    assert cfg.num_kv_heads == 1 and cfg.num_heads == 4
    assert cfg.rope_scaling["factor"] == 40


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"topk_method": "noaux_tc"}, "noaux_tc"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
        ({"topk_method": "group_limited_greedy", "n_group": 3}, "group_limited_greedy"),
        ({"rope_scaling": {"type": "fancy", "factor": 2.0}}, "fancy"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_hf({**LITE, **change})


def test_tensor_parallel_splits_whole_heads_and_experts():
    """Each rank keeps whole heads (q_b and kv_b rows, o columns) and an equal part of every
    expert; a size that does not divide the heads is refused by name."""
    from pagedserve.distributed.parallel_state import ParallelContext

    cfg = ArchConfig.from_hf({**LITE, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 8})
    single = ParallelContext.single(torch.device("cpu"))
    ranks = [
        DeepseekV2ForCausalLM(
            cfg,
            None,
            torch.float32,
            torch.device("cpu"),
            parallel=dataclasses.replace(single, tp_size=2, world_size=2, rank=r),
        )
        for r in range(2)
    ]
    head_qk, head_kv = (
        LITE["qk_nope_head_dim"] + LITE["qk_rope_head_dim"],
        LITE["qk_nope_head_dim"] + LITE["v_head_dim"],
    )
    q_b = torch.randn(4 * head_qk, 8)
    kv_b = torch.randn(4 * head_kv, LITE["kv_lora_rank"])
    o = torch.randn(LITE["hidden_size"], 4 * LITE["v_head_dim"])
    kv_a = torch.randn(LITE["kv_lora_rank"] + LITE["qk_rope_head_dim"], LITE["hidden_size"])
    up = torch.randn(LITE["moe_intermediate_size"], LITE["hidden_size"])
    for r, model in enumerate(ranks):
        assert torch.equal(
            model.shard_layer_tensor("self_attn.q_b_proj.weight", q_b),
            q_b.view(4, -1, 8)[2 * r : 2 * r + 2].reshape(-1, 8),
        )
        assert torch.equal(
            model.shard_layer_tensor("self_attn.kv_b_proj.weight", kv_b),
            kv_b.view(4, head_kv, -1)[2 * r : 2 * r + 2].flatten(0, 1),
        )
        cols = 2 * LITE["v_head_dim"]
        assert torch.equal(model.shard_layer_tensor("self_attn.o_proj.weight", o), o[:, r * cols : (r + 1) * cols])
        assert model.shard_layer_tensor("self_attn.kv_a_proj_with_mqa.weight", kv_a) is kv_a
        half = LITE["moe_intermediate_size"] // 2
        assert torch.equal(model.shard_layer_tensor("mlp.experts.3.up_proj.weight", up), up[r * half : (r + 1) * half])
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the attention heads"):
        DeepseekV2ForCausalLM(
            cfg, None, torch.float32, torch.device("cpu"), parallel=dataclasses.replace(single, tp_size=3, world_size=3)
        )


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_quantized_latent_attention_stays_close_to_transformers(method, tmp_path):
    """Every linear quantized (the low-rank query, both latent projections, experts and
    shared experts), the latent norms and the router float; the stored q_b / kv_a rows
    are put in rotate-half order at run time."""
    import math

    from test_models_vs_hf import _prompts, build_checkpoint, hf_reference

    from pagedserve import LLM, SamplingParams
    from pagedserve.quantization.base import QuantizedWeight

    model = build_checkpoint(tmp_path, "deepseekv2-qlora-grouped-yarn")
    prompts = _prompts(7)[1:3]
    expected = [hf_reference(model, p, 1) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization=method)
    layer = llm.llm_engine.runner.model.layers[0]
    for name in ("q_a", "q_b", "kv_a", "o", "gate_up", "down"):
        assert isinstance(getattr(layer, name), QuantizedWeight), name
    # kv_b_proj is absorbed into the attention: its two per-head halves dequantized.
    assert layer.w_uk.dtype == layer.w_uv.dtype == torch.float32
    assert all(isinstance(w, QuantizedWeight) for w in [*layer.w13, *layer.w2])
    assert isinstance(layer.q_a_norm, torch.Tensor) and isinstance(layer.kv_a_norm, torch.Tensor)
    assert layer.router.dtype == torch.float32
    assert layer.q_order is not None and layer.kv_a_order is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert math.isclose(got.logprobs[0][tokens[0]].logprob, logprobs[0], abs_tol=0.1)


def test_head_sizes_the_tensors_contradict_fail_at_load(tmp_path):
    import json

    from test_models_vs_hf import build_checkpoint

    from pagedserve import LLM

    build_checkpoint(tmp_path, "deepseekv2-lite-mla")
    config = json.loads((tmp_path / "config.json").read_text())
    config["v_head_dim"] += 4  # o_proj's columns say 4 heads x 12
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"self_attn\.o_proj\.weight.*\[64, 48\]"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB")


def test_expert_width_tensor_parallelism_cannot_split_is_refused_before_loading(tmp_path):
    from test_models_vs_hf import build_checkpoint

    from pagedserve import LLM

    build_checkpoint(tmp_path, "deepseekv2-lite-mla", moe_intermediate_size=33)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 must divide the experts' moe_intermediate_size \(33\)"
    ):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)


def test_latent_cache_holds_ten_times_the_blocks_of_decompressed_heads_for_v2_lite():
    """V2-Lite's published shapes (no weights): one 576-value latent per token and layer
    instead of 16 heads' keys and values of 192 each."""
    from pagedserve.executor.model_runner import kv_bytes_per_block

    lite = {**LITE, "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16}
    lite |= {"num_key_value_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
    lite |= {"v_head_dim": 128, "vocab_size": 102400}
    cfg = ArchConfig.from_hf(lite)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 288)
    latent = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    decompressed = kv_bytes_per_block(dataclasses.replace(cfg, num_kv_heads=16, head_dim=192), 16, torch.bfloat16)
    assert latent == 27 * 16 * 576 * 2
    budget = 4 * 2**30
    assert (budget // decompressed, budget // latent) == (809, 8630)


def test_engine_allocates_the_latent_cache(tmp_path):
    """The running engine's cache pair is one head of half the latent each, and its block
    count at a fixed budget follows."""
    from test_models_vs_hf import build_checkpoint

    from pagedserve import LLM

    build_checkpoint(tmp_path, "deepseekv2-lite-mla")  # kv_lora_rank 24 + rope 8
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="1MiB", block_size=16)
    runner = llm.llm_engine.runner
    k, v = runner.kv_caches[0]
    assert tuple(k.shape[1:]) == tuple(v.shape[1:]) == (16, 1, 16)
    assert runner.num_blocks == 2**20 // (3 * 2 * 16 * 16 * 4)


def test_latent_cache_swapped_out_and_back_and_forked_matches_transformers(tmp_path):
    """Swap preemption through the host tier moves the latent halves and back; n=2 forks
    share the prompt's latent blocks: transformers' greedy tokens and logprobs."""
    import math

    from test_models_vs_hf import ENGINES, MAX_NEW, _prompts, build_checkpoint, hf_reference

    from pagedserve import LLM, SamplingParams

    model = build_checkpoint(tmp_path, "deepseekv2-qlora-grouped-yarn")
    prompts = _prompts(11)
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    engine = {**ENGINES["preempting"], "kv_offload_memory": "1MiB", "preemption_mode": "swap"}
    llm = LLM(model=str(tmp_path), dtype="float32", **engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, n=2) for n in MAX_NEW]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert len(out.outputs) == 2
        for got in out.outputs:
            assert got.token_ids == tokens
            for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
                assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and eng.kv.num_swap_outs > 0
