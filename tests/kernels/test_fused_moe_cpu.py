"""The CPU platform's native fused_moe (kernels/cpu/moe.cpp) against the reference on
the conformance kit's cases, with and without packed bf16 expert weights, and its
errors for bad routing."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native

from pagedserve.kernels import build, reference
from pagedserve.testing.checks import Check
from pagedserve.testing.op_checks import OP_CASES

# Without a compiler the tests would fail: skipped only where PAGEDSERVE_NO_COMPILER=1 says so.
pytestmark = pytest.mark.skipif(build.no_compiler_declared(), reason="PAGEDSERVE_NO_COMPILER=1")


@pytest.fixture(scope="module")
def moe_ops():
    from pagedserve.kernels.cpu.moe_native import load_moe_kernels, moe_build_spec
    from pagedserve.platforms.cpu import moe_ops

    require_native(load_moe_kernels, moe_build_spec, "the MoE CPU kernel")
    return moe_ops


class _Target:
    device = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "prepared"])
def test_native_fused_moe_conforms(moe_ops, dtype, packed):
    prepare = moe_ops.prepare_moe_weights if packed else reference.prepare_moe_weights
    results = [
        Check(desc, body).run() for desc, body in OP_CASES["fused_moe"](_Target(), moe_ops.fused_moe, dtype, 0, prepare)
    ]
    assert results and all(r.status == "passed" for r in results), [r.message for r in results if r.message]


def test_bf16_expert_weights_are_packed_where_the_kernel_has_the_packed_path(moe_ops):
    from pagedserve.kernels.cpu.moe_native import load_moe_kernels

    w13, w2 = torch.randn(4, 64, 32).bfloat16(), torch.randn(4, 32, 32).bfloat16()
    p13, p2 = moe_ops.prepare_moe_weights(w13, w2)
    if not load_moe_kernels().has_packed():
        assert p13 is w13 and p2 is w2
        return
    assert p13.shape == (4, 4, 16, 16, 2) and p2.shape == (4, 2, 16, 16, 2)
    assert torch.equal(moe_ops.unpack_expert_weight(p13), w13) and torch.equal(moe_ops.unpack_expert_weight(p2), w2)
    odd = torch.randn(4, 40, 33).bfloat16()  # K odd: stays plain
    assert moe_ops.prepare_moe_weights(odd, w2)[0] is odd
    # float32 weights (the transformers comparisons) stay plain.
    f13 = w13.float()
    assert moe_ops.prepare_moe_weights(f13, w2.float())[0] is f13


def test_native_fused_moe_refuses_experts_out_of_range(moe_ops):
    x, w13, w2 = torch.randn(3, 16), torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    ids = torch.tensor([[0, 1], [2, 4], [3, 0]])
    with pytest.raises(RuntimeError, match="topk_ids holds expert 4"):
        moe_ops.fused_moe(x, w13, w2, torch.rand(3, 2), ids)
    with pytest.raises(ValueError, match="relu"):
        moe_ops.fused_moe(x, w13, w2, torch.rand(3, 2), ids.clamp(max=3), "relu")


def test_no_tokens_gives_an_empty_output(moe_ops):
    out = moe_ops.fused_moe(
        torch.randn(0, 16), torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.rand(0, 2), torch.zeros(0, 2).long()
    )
    assert out.shape == (0, 16)


def test_cpu_platform_registers_the_native_op():
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.options import CpuOptions

    ops = OpRegistry()
    register_cpu_ops(ops, CpuOptions.from_env({}))
    table = dict(ops.table())
    assert table["fused_moe"] == "cpu-native-moe" and table["prepare_moe_weights"] == "cpu-native-moe"


def test_bf16_moe_model_runs_prepared_experts_like_the_reference(tmp_path):
    """A tiny Qwen3-MoE in bf16: expert weights prepared at load (packed where the build
    can), and greedy tokens and logprobs as with the reference fused_moe swapped in."""
    transformers = pytest.importorskip("transformers")
    from pagedserve import LLM, SamplingParams
    from pagedserve.kernels.cpu.moe_native import load_moe_kernels
    from pagedserve.platforms.cpu import moe_ops
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    vocab = write_byte_tokenizer(tmp_path)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory="16MiB", enable_prefix_caching=False)
    model = llm.llm_engine.runner.model
    placement = model.placements[0]
    if placement.ops.source("fused_moe") != moe_ops.SOURCE:
        pytest.skip("the CPU platform's native MoE ops are not in use here")
    packed = load_moe_kernels().has_packed()
    assert all((layer.w13.dim() == 5) == packed and (layer.w2.dim() == 5) == packed for layer in model.layers)
    prompts = [[5, 9, 17, 33, 65, 129], [7, 11, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    native = llm.generate(prompts, params, use_tqdm=False)

    def reference_moe(x, w13, w2, weights, ids, activation="silu"):
        w13, w2 = moe_ops.unpack_expert_weight(w13), moe_ops.unpack_expert_weight(w2)
        return reference.fused_moe(x, w13, w2, weights, ids, activation)

    placement.ops.register("fused_moe", reference_moe, source="test-reference")
    want = llm.generate(prompts, params, use_tqdm=False)
    for got, ref in zip(native, want):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for tok, a, b in zip(got.outputs[0].token_ids, got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert abs(a[tok].logprob - b[tok].logprob) < 0.05
