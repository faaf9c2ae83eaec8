"""The K-quants' and IQ4_XS's gated MLP and stacked projections in one native call (the
gated tiles of kernels/cpu/quant_gguf_kpacked.cpp, quant_gguf_q2k.cpp, quant_gguf_q3k.cpp and
quant_gguf_iq4xs.cpp, and ``gguf_linear_multi_out`` over K-quant, IQ4_XS and 32-value parts):

- ``gguf_linear_silu_out`` on a repacked Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS [gate; up] weight
  is bit for bit ``silu_and_mul(gguf_linear_out(...))`` (the CPU registry's silu_and_mul),
  outputs poisoned first, at 1/3/16/17/64 rows and more, with and without bias, float32 and
  bfloat16, each row independent of the others, and within the int8-activation error of
  the float reference; gate widths not a multiple of 16 take the two ops.
- ``gguf_linear_multi_out`` on a Q4_K_M's [q; k] Q4_K beside its Q6_K v (and mixes of every
  K-quant and IQ4_XS with 32-value parts) is bit for bit the parts one by one, side by side, at every
  row and thread count (a Q4_1 part beside them too: its fp16-rounded activation sums
  quantized apart in the same call).
- A tiny Llama GGUF of K-quants (dims multiples of 256) runs its MLPs and q/k/v through
  them: logprobs within the int8-activation error of the dequantized model, and the same
  bits as the unfused ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import quantize, write_tiny_llama_gguf
from gguf_type_checks import (
    PARTS,
    check_multi_out_is_the_parts_side_by_side,
    counting_linear,
    cpu_silu_and_mul,
    nan_outputs,
)

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight

KTYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")
#: Relative error of the gated op against the float reference: the int8 activations' error
#: of both halves of the product (the conformance kit's allowance for this op) plus bf16.
GATED_REL = 3e-2 + 1e-2


def _has(name: str, type_name: str) -> bool:
    module = load_quant_kernels()
    if module is None or not module.has_packed():
        return False
    return bool(getattr(module, name)(ref.GGUF_TYPE_IDS[type_name]))


def _needs(name: str, type_name: str) -> None:
    if not _has(name, type_name):
        pytest.skip(f"no {name} kernel for {type_name} in this build")


def _blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [n, row bytes]: Gaussian rows (an offset on some, so minimums and signed scales
    matter) quantized by the test quantizer (K-quants) or gguf.quants."""
    x = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    return torch.from_numpy(quantize(x, type_name)).reshape(n, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", KTYPES)
def test_gated_equals_the_two_ops_bit_for_bit(type_name, dtype):
    """Odd and even gate column-group counts (3 and 4 groups of 16), K 256 and 512, partial
    row tiles; the output poisoned before the kernel writes it."""
    _needs("has_kpacked_gated", type_name)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    silu_and_mul = cpu_silu_and_mul()
    rng = np.random.default_rng(41)
    gen = torch.Generator().manual_seed(41)
    for d, k in ((48, 256), (64, 512)):
        raw = _blocks(type_name, 2 * d, k, rng)
        packed = cpu_quant.prepare_gguf_weight(raw, type_name)
        assert packed.dim() == 3 and packed.shape[0] == 2 * d // 16
        for bias in (None, torch.randn(2 * d, generator=gen).to(dtype)):
            for m in (1, 3, 16, 17, 64):
                x = torch.randn(m, k, generator=gen).to(dtype)
                want = silu_and_mul(module.gguf_linear_out(x, packed, tid, bias))
                with nan_outputs():
                    got = module.gguf_linear_silu_out(x, packed, tid, bias)
                assert got.dtype == dtype and got.shape == (m, d)
                assert torch.isfinite(got).all()
                assert torch.equal(got, want), (d, k, m, bias is None)
                # Against the float reference (the dequantized blocks, unquantized x).
                ref_out = reference.gguf_linear_silu_and_mul(x.float(), raw, type_name, bias)
                rel = ((got.float() - ref_out).norm() / ref_out.norm()).item()
                assert rel < GATED_REL, (d, k, m, rel)


@pytest.mark.parametrize("type_name", KTYPES)
def test_gated_rows_are_batch_invariant(type_name):
    """A row's result is the same bits alone, in a partial row tile or among 70."""
    _needs("has_kpacked_gated", type_name)
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS[type_name]
    rng = np.random.default_rng(42)
    k, d = 256, 32
    packed = cpu_quant.prepare_gguf_weight(_blocks(type_name, 2 * d, k, rng), type_name)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(42)).bfloat16()
    full = module.gguf_linear_silu_out(x, packed, tid)
    for i in (0, 5, 33, 69):
        for count in (1, 2, 3, 5, 6, 7):
            part = x[i : i + count]
            assert torch.equal(module.gguf_linear_silu_out(part, packed, tid)[0], full[i]), (i, count)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q3_K", "IQ4_XS"])
def test_gated_op_takes_the_kernel_or_the_two_ops(type_name):
    """The registered op runs the gated kernel on a repacked [gate; up] of an even number of
    column groups (the linear op is not called), and the two ops (linear, then silu_and_mul)
    on gate widths not a multiple of 16 (odd group counts, rows not repacked) and float16."""
    _needs("has_kpacked_gated", type_name)
    rng = np.random.default_rng(43)
    gen = torch.Generator().manual_seed(43)
    silu_and_mul = cpu_silu_and_mul()
    linear, calls = counting_linear()
    fused = cpu_quant.make_gguf_linear_silu_and_mul(linear, silu_and_mul)
    k = 256
    x = torch.randn(5, k, generator=gen).bfloat16()
    for d, takes_kernel in ((32, True), (24, False), (40, False), (20, False)):
        raw = _blocks(type_name, 2 * d, k, rng)
        data = cpu_quant.prepare_gguf_weight(raw, type_name)
        calls.clear()
        got = fused(x, data, type_name)
        assert calls == ([] if takes_kernel else [type_name]), d
        assert got.shape == (5, d)
        assert torch.equal(got, silu_and_mul(cpu_quant.gguf_linear(x, data, type_name))), d
    calls.clear()
    x16 = x.half()
    data = cpu_quant.prepare_gguf_weight(_blocks(type_name, 64, k, rng), type_name)
    assert torch.equal(fused(x16, data, type_name), silu_and_mul(cpu_quant.gguf_linear(x16, data, type_name)))
    assert calls == [type_name]


def test_gated_kernel_entry_refuses_bad_arguments():
    _needs("has_kpacked_gated", "Q4_K")
    module, tid = load_quant_kernels(), ref.GGUF_TYPE_IDS["Q4_K"]
    rng = np.random.default_rng(44)
    raw = _blocks("Q4_K", 64, 256, rng)
    packed = cpu_quant.prepare_gguf_weight(raw, "Q4_K")
    x = torch.randn(3, 256)
    with pytest.raises(RuntimeError, match="packed"):
        module.gguf_linear_silu_out(x, raw, tid)
    with pytest.raises(RuntimeError, match="bias"):
        module.gguf_linear_silu_out(x, packed, tid, torch.zeros(63))
    with pytest.raises(RuntimeError, match="gate and up|2 x a multiple of 16"):
        module.gguf_linear_silu_out(x, cpu_quant.prepare_gguf_weight(raw[:48], "Q4_K"), tid)
    with pytest.raises(RuntimeError, match="multiple of 256|does not hold"):
        module.gguf_linear_silu_out(torch.randn(3, 512), packed, tid)


# --- stacked ---------------------------------------------------------------------------

#: Parts (type, rows): a Q4_K_M's [q; k] Q4_K beside its Q6_K v, a Q5_K_M's, every K-quant
#: and IQ4_XS beside 32-value parts (an IQ4_XS [q; k] beside a Q4_K and a Q8_0 v); column
#: groups of unequal sizes so that threads' shares end inside parts.
MIXES = [
    (("Q4_K", 48), ("Q6_K", 16)),
    (("Q5_K", 32), ("Q6_K", 16), ("Q8_0", 16)),
    (("Q6_K", 16), ("Q4_0", 32), ("Q3_K", 16), ("Q2_K", 32)),
    (("Q5_0", 32), ("Q4_K", 16), ("IQ4_NL", 16), ("Q5_1", 16)),
    (("Q4_1", 16), ("Q4_K", 32), ("Q4_1", 16), ("Q6_K", 16)),
    (("IQ4_XS", 32), ("Q4_K", 16), ("Q8_0", 16)),
    (("Q4_1", 16), ("IQ4_XS", 16), ("Q3_K", 16), ("IQ4_NL", 16)),
]


def _packed_parts(mix, k, rng):
    blocks = [_blocks(t, n, k, rng) for t, n in mix]
    return blocks, [cpu_quant.prepare_gguf_weight(b, t) for b, (t, _) in zip(blocks, mix)]


def _mix_available(mix) -> bool:
    module = load_quant_kernels()
    return (
        module is not None
        and module.has_packed()
        and all(t not in cpu_quant.KPACKED_TYPES or module.has_kpacked(ref.GGUF_TYPE_IDS[t]) for t, _ in mix)
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(t for t, _ in m))
def test_native_stacked_call_is_the_parts_side_by_side(mix, threads):
    if not _mix_available(mix):
        pytest.skip("no tiled kernel for every part here")
    rng = np.random.default_rng(45)
    gen = torch.Generator().manual_seed(45)
    _, packed = _packed_parts(mix, 512, rng)
    dtypes, rows = (torch.float32, torch.bfloat16), (1, 3, 16, 17, 64)
    check_multi_out_is_the_parts_side_by_side(
        packed, [t for t, _ in mix], gen, threads, dtypes, rows, float32_out_of_float32=False
    )


def test_stacked_op_agrees_with_the_reference_and_takes_one_call():
    """The registered op on [q; k] Q4_K + Q6_K v: one native call (the linear op is not
    called), within the int8-activation error of the float reference; a Q4_1 part beside a
    K-quant (its activation sums rounded otherwise) and an IQ4_XS part beside a K-quant in
    one call too, the parts' bits; a part left in the file's blocks (rows not a multiple of
    16) makes the op go part by part."""
    mix = (("Q4_K", 48), ("Q6_K", 16))
    if not _mix_available(mix):
        pytest.skip("no tiled K-quant kernel here")
    rng = np.random.default_rng(46)
    gen = torch.Generator().manual_seed(46)
    k = 256
    blocks, packed = _packed_parts(mix, k, rng)
    types = [t for t, _ in mix]
    linear, calls = counting_linear()
    op = cpu_quant.make_gguf_linear_stacked(linear)
    bias = torch.randn(64, generator=gen)
    for m in (1, 9, 70):
        x = torch.randn(m, k, generator=gen).bfloat16()
        for out_dtype in (None, torch.float32):
            calls.clear()
            got = op(x, packed, types, bias, out_dtype)
            assert calls == []
            want = reference.gguf_linear_stacked(x, blocks, types, bias, out_dtype)
            assert got.dtype == want.dtype == (out_dtype or x.dtype)
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel < 2.5e-2 + 1e-2, (m, out_dtype, rel)
    q41 = cpu_quant.prepare_gguf_weight(_blocks("Q4_1", 16, k, rng), "Q4_1")
    rows24 = cpu_quant.prepare_gguf_weight(_blocks("Q6_K", 24, k, rng), "Q6_K")
    assert rows24.dim() == 2
    x = torch.randn(4, k, generator=gen)
    cases = [([packed[0], q41], ["Q4_K", "Q4_1"], []), ([packed[0], rows24], ["Q4_K", "Q6_K"], ["Q4_K", "Q6_K"])]
    if _mix_available((("IQ4_XS", 16),)):
        # IQ4_XS's tiled kernel runs as one part of the native call.
        iq4xs = cpu_quant.prepare_gguf_weight(_blocks("IQ4_XS", 16, k, rng), "IQ4_XS")
        assert iq4xs.dim() == 3
        cases.append(([iq4xs, packed[0]], ["IQ4_XS", "Q4_K"], []))
    for parts, names, want_calls in cases:
        calls.clear()
        got = op(x, parts, names)
        assert calls == want_calls
        want = torch.cat([cpu_quant.gguf_linear(x, d, t) for d, t in zip(parts, names)], -1)
        assert torch.equal(got, want), names


# --- a tiny K-quant model --------------------------------------------------------------

#: A Q4_K_M-like layer ([q; k] Q4_K beside a Q6_K v, gate/up Q4_K, down Q6_K), a Q5_K_M-like
#: one with a Q8_0 v, and a Q3_K / Q2_K one.
LAYER_TYPES = (
    dict(zip(PARTS, ("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"))),
    dict(zip(PARTS, ("Q5_K", "Q5_K", "Q8_0", "Q5_K", "Q5_K", "Q5_K", "Q6_K"))),
    dict(zip(PARTS, ("Q3_K", "Q3_K", "Q4_K", "Q3_K", "Q2_K", "Q2_K", "Q3_K"))),
)


def _unfused(w):
    """``w`` multiplying part by part and gate/up through the two ops (the unfused path)."""
    if isinstance(w, StackedWeight):
        s = StackedWeight(w.parts)
        s._stacked_op = None
        return s
    if isinstance(w, GGUFWeight):
        w.gated_op = None
    return w


def test_tiny_kquant_model_runs_fused_with_the_dequantized_models_logprobs(tmp_path):
    from test_quant_support import sequence_logprobs

    from pagedserve import LLM

    module = load_quant_kernels()
    if module is None or not all(_has("has_kpacked_gated", t) for t in ("Q4_K", "Q5_K", "Q2_K")):
        pytest.skip("no gated K-quant kernels in this build")
    path = write_tiny_llama_gguf(tmp_path / "kq.gguf", LAYER_TYPES, "Q6_K", name="tiny k-quant")
    kw = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    ids = list(range(3, 60))
    want = sequence_logprobs(LLM(model=str(path), quantization="none", **kw), ids)
    kept = LLM(model=str(path), quantization="gguf", **kw)
    engine = kept.llm_engine
    model = engine.runner.model
    for i, layer in enumerate(model.layers):
        types = LAYER_TYPES[i]
        assert isinstance(layer.gate_up, GGUFWeight) and layer.gate_up.type_name == types["ffn_gate"]
        assert layer.gate_up.gated_op is engine.ops.gguf_linear_silu_and_mul
        assert layer.gate_up.packed is not None and layer.gate_up.packed.dim() == 3
        assert isinstance(layer.qkv, StackedWeight) and layer.qkv._stacked_op is not None
        assert [p.type_name for p in layer.qkv.parts] == [types["attn_q"], types["attn_v"]]
    assert engine.ops.source("gguf_linear_silu_and_mul").startswith("cpu-native-quant")
    fused = sequence_logprobs(kept, ids)
    assert torch.isfinite(fused).all()
    # Only the int8 activations differ from the dequantized model (as the mixed-type model
    # of test_quant_gguf_kquants.py: measured max |dlogprob| ~0.1 against logprobs of
    # mean ~ -7).
    diff = (fused - want).abs()
    assert diff.max().item() < 0.3 and diff.mean().item() < 0.08, (diff.max().item(), diff.mean().item())
    # The unfused ops: the same bits.
    for layer in model.layers:
        layer.gate_up = _unfused(layer.gate_up)
        layer.qkv = _unfused(layer.qkv)
    unfused = sequence_logprobs(kept, ids)
    assert torch.equal(fused, unfused)


def test_cpu_conformance_cases_of_the_256_value_types():
    """The kit's gated and stacked cases with a K-quant or IQ4_XS in them, on the CPU's own ops."""
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    if "gguf_linear_stacked" not in target.overridden_ops():
        pytest.skip("the CPU platform keeps the registry's composite ops here")
    ids = ("op:gguf_linear_silu_and_mul[", "op:gguf_linear_stacked[")
    checks = [c for c in op_checks(target) if c.id.startswith(ids) and ("_K" in c.id or "IQ4_XS" in c.id)]
    assert len(checks) >= 2 * (6 * 3 + 4 * 2)  # dtypes x (gated types x shapes + stacked mixes x shapes)
    assert any("gguf_linear_silu_and_mul" in c.id and "IQ4_XS" in c.id for c in checks)
    assert any("gguf_linear_stacked" in c.id and "IQ4_XS" in c.id for c in checks)
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)
