"""The cost model's routed experts on the host (``experts_hw``, ``--experts-hardware``):
each term recomputed by hand from the spec and the two profiles, and the plan of a
Qwen3-MoE-30B-shaped config on an H100 profile with its experts on a host profile."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.simulate.cost_model import CostModel, StepBatch
from pagedserve.simulate.hardware import HardwareProfile
from pagedserve.simulate.model_spec import ModelSpec

MOE = ModelSpec(
    name="moe",
    num_layers=3,
    hidden_size=256,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=1000,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    attn_params=160_000,
    dense_mlp_params=300_000,
    num_experts=16,
    experts_per_token=2,
    expert_params=3 * 256 * 64,
    num_moe_layers=2,
    moe_shared_params=20_000,
)
GPU = HardwareProfile(
    name="gpu",
    memory_bytes=80e9,
    memory_bandwidth=3e12,
    peak_flops={"bfloat16": 900e12},
    host_bandwidth=50e9,
    interconnect_latency_s=7e-6,
    efficiency={"matmul": 0.5, "memory": 0.8, "host": 0.75},
)
HOST = HardwareProfile(
    name="host",
    memory_bytes=512e9,
    memory_bandwidth=300e9,
    peak_flops={"bfloat16": 8e12},
    efficiency={"matmul": 0.4, "memory": 0.6},
)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_terms_by_hand(tokens):
    batch = StepBatch(q_lens=[tokens], ctx_lens=[tokens + 40], num_samples=1)
    base = CostModel(MOE, GPU).breakdown(batch)
    placed = CostModel(MOE, GPU, experts_hw=HOST)
    got = placed.breakdown(batch)
    L, k, Pe, H = MOE.num_moe_layers, MOE.experts_per_token, MOE.expert_params, MOE.hidden_size
    touched = MOE.num_experts * (1 - (1 - k / MOE.num_experts) ** tokens)
    # The host: its matmul rate (peak x efficiency) against reading the touched experts.
    want_experts = max(2 * tokens * L * k * Pe / (8e12 * 0.4), L * touched * Pe * 2 / (300e9 * 0.6))
    assert got["experts"] == pytest.approx(want_experts, rel=1e-12)
    # Two crossings per MoE layer: H bf16 values each way, 12 k routing bytes in.
    want_cross = L * (2 * 7e-6 + tokens * (2 * H * 2 + 12 * k) / (50e9 * 0.75))
    assert got["expert_crossing"] == pytest.approx(want_cross, rel=1e-12)
    # The device keeps attention, dense layers, router and shared weights.
    dense = (MOE.num_layers - L) * (MOE.attn_params + MOE.dense_mlp_params) + L * (
        MOE.attn_params + MOE.moe_shared_params
    )
    want_linear = max(2 * tokens * dense / (900e12 * 0.5), dense * 2 / (3e12 * 0.8))
    assert got["linear"] == pytest.approx(want_linear, rel=1e-12)
    assert got["linear"] < base["linear"]
    for term in ("attention", "lm_head", "elementwise", "overhead"):
        assert got[term] == base[term]
    assert "experts" not in base and "expert_crossing" not in base
    expert_bytes = L * MOE.num_experts * Pe * 2
    assert placed.expert_bytes_on_host() == expert_bytes
    assert CostModel(MOE, GPU).weight_bytes_per_device() - placed.weight_bytes_per_device() == expert_bytes


def test_refusals():
    dense = ModelSpec(**{**MOE.__dict__, "num_experts": 0, "num_moe_layers": 0, "experts_per_token": 0})
    with pytest.raises(ValueError, match="no routed experts"):
        CostModel(dense, GPU, experts_hw=HOST)
    with pytest.raises(ValueError, match="tensor/pipeline parallelism"):
        CostModel(
            MOE,
            GPU.__class__(**{**GPU.__dict__, "interconnect_bandwidth": 1e11}),
            experts_hw=HOST,
            tensor_parallel_size=2,
        )
    with pytest.raises(ValueError, match="no host_bandwidth"):
        CostModel(MOE, HOST, experts_hw=HOST)


#: Qwen3-30B-A3B's published shape (config.json of the Hugging Face checkpoint).
QWEN3_MOE_30B = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_cli_prices_a_qwen3_moe_30b_on_an_h100_with_experts_on_the_host(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_MOE_30B))
    runs = {}
    for name, extra in (("gpu", []), ("host", ["--experts-hardware", "cpu-generic"])):
        out = tmp_path / f"{name}.json"
        args = ["simulate", "--model", str(cfg), "--hardware", "h100-sxm", "--num-prompts", "8"]
        args += ["--input-len", "256", "--output-len", "32", "--max-model-len", "4096", "--json-out", str(out)]
        assert main(args + extra) == 0
        runs[name] = json.loads(out.read_text())
    gpu, host = runs["gpu"], runs["host"]
    experts = 48 * 128 * 3 * 2048 * 768 * 2  # bf16 bytes of the routed experts
    assert host["config"]["expert_bytes_on_host"] == experts
    assert host["config"]["experts_hardware"] == "cpu-generic"
    assert gpu["config"]["weight_bytes_per_device"] - host["config"]["weight_bytes_per_device"] == experts
    # The freed device memory holds more KV blocks; the host's experts make tokens slower.
    assert host["config"]["num_kv_blocks"] > gpu["config"]["num_kv_blocks"]
    assert host["simulated"]["tpot_s"]["p50"] > gpu["simulated"]["tpot_s"]["p50"]
    busy = host["simulated"]["time_breakdown_s"]
    assert busy["experts"] > 0 and busy["expert_crossing"] > 0
