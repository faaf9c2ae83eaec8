"""GPT-OSS experts in the ``fused_moe`` op ("swigluoai" with alpha/limit, expert
biases): the reference against transformers' ``GptOssExperts`` (interleaved gate/up
columns converted to pagedserve's cat(gate, up) rows), and the CPU platform's op
through the conformance cases."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native

from pagedserve.kernels import reference
from pagedserve.testing.checks import Check
from pagedserve.testing.op_checks import OP_CASES

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("limit", [7.0, 0.8])
def test_reference_matches_transformers_gpt_oss_experts(limit):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=24, intermediate_size=20, num_local_experts=5, swiglu_limit=limit)
    gen = torch.Generator().manual_seed(7)
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    x = torch.randn(9, 24, generator=gen) * 2
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(9)])
    weights = torch.softmax(torch.randn(9, 2, generator=gen), -1)
    with torch.no_grad():
        want = experts(x, ids, weights)
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gu[:, :, 0::2], gu[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()  # [E, 2I, H]
    b13 = torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    got = reference.fused_moe(
        x, w13, w2, weights, ids, "swigluoai", b13, experts.down_proj_bias.detach(), cfg.swiglu_alpha, limit
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_refuses_an_unknown_activation_naming_swigluoai():
    with pytest.raises(ValueError, match="swigluoai"):
        reference.fused_moe(
            torch.randn(2, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4), torch.ones(2, 1),
            torch.zeros(2, 1, dtype=torch.int64), "relu",
        )  # fmt: skip


class _Target:
    device = torch.device("cpu")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_platform_op_passes_the_gpt_oss_cases(dtype, packed):
    """Prepared (possibly packed bf16) expert weights too: the GPT-OSS path unpacks them."""
    from pagedserve.platforms.cpu.moe_ops import fused_moe, prepare_moe_weights

    prepare = prepare_moe_weights if packed else reference.prepare_moe_weights
    results = [Check(d, b).run() for d, b in OP_CASES["fused_moe"](_Target(), fused_moe, dtype, 0, prepare)]
    oai = [r for r in results if "swigluoai" in r.id]
    assert len(oai) == 4 and all(r.status == "passed" for r in results), [r.message for r in results if r.message]


def test_cpu_native_kernel_runs_gpt_oss_experts_without_the_reference(monkeypatch):
    """Plain expert weights with biases and swigluoai go to the native kernel."""
    from pagedserve.kernels import build
    from pagedserve.kernels.cpu.moe_native import load_moe_kernels, moe_build_spec
    from pagedserve.platforms.cpu import moe_ops

    spec = moe_build_spec()
    if build.unsupported_arch_flags(list(spec.arch_flags), build.read_cpu_features()):
        pytest.skip("this CPU lacks instructions the MoE kernel's build uses")  # not applicable here
    require_native(load_moe_kernels, moe_build_spec, "the MoE CPU kernel")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(13, 48, generator=gen) * 4
    w13 = torch.randn(5, 2 * 24, 48, generator=gen) * 0.2
    w2 = torch.randn(5, 48, 24, generator=gen) * 0.2
    b13, b2 = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(13)])
    weights = torch.softmax(torch.randn(13, 2, generator=gen), -1)
    want = reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", b13, b2, 1.5, 2.0)

    def refuse(*_a, **_k):
        raise AssertionError("fell back to the reference")

    monkeypatch.setattr(moe_ops.reference, "fused_moe", refuse)
    got = moe_ops.fused_moe(x, w13, w2, weights, ids, "swigluoai", b13, b2, 1.5, 2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
