"""The registry's *quantized* and *tensor parallel* columns, proven for every family
beyond the Llama and Qwen2 of tests/quantization and tests/distributed (and the hybrid
families of test_models_hybrid_tp.py): load-time int8
stays close to transformers; two tensor-parallel ranks (mp executor, gloo) give
transformers' greedy tokens and logprobs (experts of MoE families included: quantized
experts through their own path, sharded experts through ``fused_moe``); a family class
that does not shard refuses tensor parallelism at load."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from test_models_vs_hf import CASES, _prompts, build_checkpoint, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.models import model_entries
from pagedserve.quantization import Int8Weight

QUANTIZED = [
    "mistral-window",
    "qwen3-qknorm-head40",
    "granite-multipliers",
    "smollm3-nope",
    "olmo2-postnorm",
    "gemma-head24",
    "gemma2-window-softcap",
    "gemma3-window-local-rope",
    "phi3-partial-rotary-window",
    "glm4-interleaved-partial-rope",
    "starcoder2-layernorm-window",
    "mixtral-top2-window",
    "qwen2moe-shared-dense-layer",
    "qwen3moe-qknorm",
    "deepseekv2-lite-mla",
    "deepseekv2-qlora-grouped-yarn",
    "deepseekv3-groups-yarn",
    "olmo3-window-per-type-rope",
    "gemma4-k-eq-v-global-kv-heads",
]


def test_every_quantized_family_is_covered():
    marked = {e.architecture for e in model_entries() if e.quantized} - {"LlamaForCausalLM", "Qwen2ForCausalLM"}
    assert marked == {CASES[c][1] for c in QUANTIZED}


@pytest.mark.parametrize("case", QUANTIZED)
def test_int8_weights_stay_close_to_transformers(case, tmp_path):
    model = build_checkpoint(tmp_path, case)
    prompts = _prompts(5)[1:4]
    expected = [hf_reference(model, p, 1) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="int8")
    model = llm.llm_engine.runner.model
    for layer in model.layers:
        assert isinstance(layer.o, Int8Weight)
        for name in (*type(model).linear_fields, "w13", "w2"):  # experts: one weight each
            w = getattr(layer, name, None)
            weights = w if isinstance(w, list) else [w] if w is not None else []
            assert all(isinstance(t, Int8Weight) for t in weights), name
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        got = out.outputs[0]
        # Weight-only int8 moves logprobs by ~1e-3 here; greedy ties are not this close.
        assert got.token_ids == tokens
        assert math.isclose(got.logprobs[0][tokens[0]].logprob, logprobs[0], abs_tol=0.05)


def test_quantized_experts_follow_the_fused_moe_reference():
    """The quantized-expert path against ``fused_moe``'s reference on the experts'
    dequantized weights: the same grouping, so the same result up to float rounding."""
    import torch

    from pagedserve.kernels import reference
    from pagedserve.models.layers import route_topk
    from pagedserve.models.quantized_experts import quantized_experts_moe
    from pagedserve.quantization.int8 import quantize_int8_per_channel

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 5, 24, 16, 11
    w13 = [
        Int8Weight(*quantize_int8_per_channel(torch.randn(2 * inter, hidden, generator=gen))) for _ in range(experts)
    ]
    w2 = [Int8Weight(*quantize_int8_per_channel(torch.randn(hidden, inter, generator=gen))) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=gen), 2, True)
    ops = SimpleNamespace(silu_and_mul=reference.silu_and_mul)
    got = quantized_experts_moe(ops, x, w13, w2, weights, ids)
    dense13 = torch.stack([w.dequantize() for w in w13])
    dense2 = torch.stack([w.dequantize() for w in w2])
    want = reference.fused_moe(x, dense13, dense2, weights, ids, "silu")
    assert ids[:, 0].unique().numel() > 1  # tokens reach several experts
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_partly_quantized_experts_keep_each_weight_as_loaded():
    """A layer whose expert gate/up are quantized beside float down weights (a GGUF
    down_proj dequantized for its tensor-parallel shard) keeps per-expert lists, each
    weight as loaded, and runs them to ``fused_moe``'s reference on the dequantized
    weights; an all-float layer is still stacked for ``fused_moe``."""
    import torch

    from pagedserve.kernels import reference
    from pagedserve.models.layers import fuse, route_topk
    from pagedserve.models.quantized_experts import prepare_expert_lists, quantized_experts_moe, stack_experts
    from pagedserve.quantization.int8 import quantize_int8_per_channel

    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens = 4, 24, 16, 9
    gate_up = [
        [Int8Weight(*quantize_int8_per_channel(torch.randn(inter, hidden, generator=gen))) for _ in range(2)]
        for _ in range(experts)
    ]
    down = [torch.randn(hidden, inter, generator=gen) for _ in range(experts)]
    w13, w2 = stack_experts(gate_up, down, lambda t: t, fuse, "test")
    assert isinstance(w13, list) and isinstance(w2, list)
    assert all(isinstance(w, Int8Weight) for w in w13) and all(isinstance(w, torch.Tensor) for w in w2)
    ops = SimpleNamespace(
        silu_and_mul=reference.silu_and_mul, linear=reference.linear, prepare_linear_weight=lambda w: w.clone()
    )
    w13, w2 = prepare_expert_lists(ops, w13, w2)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=gen), 2, True)
    got = quantized_experts_moe(ops, x, w13, w2, weights, ids)
    dense13 = torch.stack([torch.cat([w.dequantize() for w in pair]) for pair in gate_up])
    want = reference.fused_moe(x, dense13, torch.stack(down), weights, ids, "silu")
    assert ids[:, 0].unique().numel() > 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    floats = [[w.dequantize() for w in pair] for pair in gate_up]
    s13, s2 = stack_experts(floats, down, lambda t: t, fuse, "test")
    assert torch.equal(s13, dense13) and torch.equal(s2, torch.stack(down))


def test_registry_and_classes_agree_on_tensor_parallelism():
    for e in model_entries():
        assert e.load().tensor_parallel == e.tensor_parallel, e.architecture


def test_a_family_without_tensor_parallelism_refuses_it():
    from pagedserve.models.llama import LlamaForCausalLM

    class Unsharded(LlamaForCausalLM):
        tensor_parallel = False

    cfg = SimpleNamespace(architecture="UnshardedForCausalLM")
    with pytest.raises(ValueError, match="UnshardedForCausalLM does not support tensor parallelism"):
        Unsharded(cfg, None, None, None, SimpleNamespace(tp_size=2))


TP_CASES = [
    "gemma2-window-softcap",
    "qwen3-qknorm-head40",
    "mistral-window",
    "granite-multipliers",
    "smollm3-nope",
    "gemma-head24",
    "gemma3-window-local-rope",
    "phi3-partial-rotary-window",
    "olmo2-postnorm",
    "glm4-interleaved-partial-rope",
    "starcoder2-layernorm-window",
    "mixtral-top2-window",
    "qwen2moe-shared-dense-layer",
    "qwen3moe-qknorm",
    "deepseekv2-lite-mla",
    "deepseekv2-qlora-grouped-yarn",
    "deepseekv3-groups-yarn",
    "olmo3-window-per-type-rope",
    "gptoss-sinks-window-moe",
    "gemma4-k-eq-v-global-kv-heads",
]


def test_every_tensor_parallel_family_is_covered():
    from test_models_hybrid_tp import TP_CASES as HYBRID_TP_CASES
    from test_models_hybrid_vs_hf import CASES as HYBRID_CASES

    marked = {e.architecture for e in model_entries() if e.tensor_parallel} - {"LlamaForCausalLM", "Qwen2ForCausalLM"}
    hybrid = {HYBRID_CASES[c][1] for c in HYBRID_TP_CASES}  # tests/models/test_models_hybrid_tp.py
    falcon = {"FalconH1ForCausalLM"}  # tests/models/test_models_falcon_h1.py::test_falcon_h1_tp2_*
    assert marked == {CASES[c][1] for c in TP_CASES} | hybrid | falcon


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_matches_transformers(case, tmp_path):
    _check_tp2(case, tmp_path)


#: Extra shapes: a KV head shared by both ranks (OLMo 2's k norm then counts it once;
#: Phi-3's fused qkv_proj gives each rank the same k and v rows).
TP_EXTRA = {
    "olmo2-postnorm": dict(num_key_value_heads=1),
    "phi3-partial-rotary-window": dict(num_key_value_heads=1),
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(TP_EXTRA))
def test_tp2_with_a_shared_kv_head_matches_transformers(case, tmp_path):
    _check_tp2(case, tmp_path, **TP_EXTRA[case])


def _check_tp2(case: str, tmp_path, **extra) -> None:
    import torch.distributed as dist

    model = build_checkpoint(tmp_path, case, **extra)
    prompts = _prompts(9)[1:4]
    expected = [hf_reference(model, p, 6) for p in prompts]
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=8,
        block_size=4,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        assert llm.llm_engine.runner.model.num_heads == CASES[case][2].get("num_attention_heads", 4) // 2
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        for out, (tokens, logprobs) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
            got = out.outputs[0]
            assert got.token_ids == tokens
            for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
                assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
