"""IQ4_NL (ggml's non-linear 4-bit blocks) kept in its blocks on the CPU.

- The torch reference dequantizer equals ``gguf.quants`` (an independent implementation)
  on random blocks; the test quantizer (gguf_blocks.py) writes blocks ``gguf.quants`` reads
  back within the format's rounding.
- The native kernels against the reference on random blocks and activations, outputs
  poisoned (NaN) before they write them: the row kernel (the file's blocks, rows not a
  multiple of 16) and the tiled kernel (repacked at load, Q4_0's entry) within float32
  summation of the product with the activations rounded to int8 blocks as the kernels
  round them, and within the int8-activation allowance of the float reference; the tiled
  kernel equals the row kernel to float32 summation order, each row alone the same as
  among others; the gated and stacked ops are the plain op's numbers bit for bit;
  embedding rows come from the repacked form exactly.
- The CPU declares ``gguf_type:IQ4_NL`` and passes the conformance kit's IQ4_NL cases;
  the Triton kernel takes IQ4_NL under the interpreter.
- A tiny Llama GGUF of IQ4_NL tensors (beside Q8_0 / Q5_0 parts in fused projections)
  loads kept and gives the dequantized model's logprobs within the int8-activation error.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf_blocks import quantize, run_triton_interpreted, write_tiny_llama_gguf
from native_build import require_native
from test_quant_gguf_kquants import check_kept_against_dequantized

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels, quant_build_spec
from pagedserve.models.layers import fuse
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, gguf_kept_types

T = "IQ4_NL"
TID = ref.GGUF_TYPE_IDS[T]


def native():
    return require_native(load_quant_kernels, quant_build_spec, "the quantized CPU kernels")


def packed_kernel(module):
    if not module.has_packed():
        pytest.skip("no AVX-512 VNNI tiled GGUF kernel here")
    return module


@contextlib.contextmanager
def nan_outputs():
    """torch's deterministic mode: every new tensor (a kernel's output too) starts as NaN."""
    prior = torch.utils.deterministic.fill_uninitialized_memory, torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.empty(4).isnan().all()
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = prior[0]
        torch.use_deterministic_algorithms(prior[1])


def random_blocks(n: int, k: int, gen: torch.Generator, type_name: str = T) -> torch.Tensor:
    """uint8 [n, row bytes]: random nibbles with finite, realistic fp16 scales (d at byte 0)."""
    bb = ref.GGUF_BLOCK_BYTES[type_name]
    raw = torch.randint(0, 256, (n, k // 32, bb), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3
    raw[..., 0:2] = scale.half().view(torch.uint8).reshape(n, k // 32, 2)
    if type_name in ("Q4_1", "Q5_1"):
        raw[..., 2:4] = (torch.randn(n, k // 32, generator=gen) * 0.05).half().view(torch.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def int8_activation_reference(x: torch.Tensor, raw: torch.Tensor, type_name: str = T) -> torch.Tensor:
    """x rounded as the kernels round it (int8 per 32 values, scale max|x|/127 rounded to
    fp16), times the dequantized weight, in float64: what the kernels compute exactly."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    d = (amax / 127.0).half().float()
    xq = (torch.round(blocks * inv) * d).reshape(x.shape)
    return (xq.double() @ ref.dequantize_gguf(raw, type_name).double().t()).float()


def check_kernel_output(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, what) -> None:
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), what
    exact = int8_activation_reference(x, raw)
    assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item(), what
    want = x.float() @ ref.dequantize_gguf(raw, T).t()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2.5e-2, (what, rel)


# --- format ----------------------------------------------------------------------------


def test_reference_dequantizer_matches_gguf_quants():
    import gguf

    gen = torch.Generator().manual_seed(1)
    raw = random_blocks(6, 512, gen)
    # Scales of any sign and size too (only NaN/inf fp16 fields are left out).
    mixed = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
    for data in (raw, mixed):
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.IQ4_NL)
        got = ref.dequantize_gguf(data, T)
        finite = np.isfinite(want)
        assert got.shape == want.shape == (6, 512) and finite.mean() > 0.5
        np.testing.assert_array_equal(got.numpy()[finite], want[finite])
    assert ref.IQ4_NL_VALUES == tuple(int(v) for v in gguf.quants.IQ4_NL.kvalues)
    assert ref.GGUF_BLOCK_BYTES[T] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL][1]


def test_test_quantizer_blocks_read_back_with_gguf():
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 768)) * 0.1).astype(np.float32)
    x[1] += 0.2  # an offset row
    x[2, :32] = 0  # an all-zero block
    raw = quantize(x, T)
    assert raw.shape == (5, ref.gguf_row_bytes(T, 768)) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_NL)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.08  # measured 0.071
    assert not back[2, :32].any()
    assert np.array_equal(ref.dequantize_gguf(torch.from_numpy(raw), T).numpy(), back)


# --- the native kernels ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(dtype):
    """The file's blocks (the row kernel): K 96 and the default model's 576 and 1536."""
    module = native()
    gen = torch.Generator().manual_seed(3)
    with nan_outputs():
        for k in (96, 576, 1536):
            for m in (1, 3, 17, 64):
                n = 40 if m != 17 else 24
                raw = random_blocks(n, k, gen)
                x = torch.randn(m, k, generator=gen).to(dtype)
                got = module.gguf_linear(x, raw, TID)
                check_kernel_output(got, x, raw, (k, m))
                # The registered op: bias, x's dtype, the same numbers.
                bias = torch.randn(n, generator=gen)
                y = cpu_quant.gguf_linear(x, raw, T, bias)
                assert y.dtype == dtype
                assert torch.equal(y.float(), (got + bias).to(dtype).float())
                for i in {0, m - 1}:
                    assert torch.equal(module.gguf_linear(x[i : i + 1], raw, TID)[0], got[i])


def test_repacking_is_lossless_and_q4_0s_layout():
    module = packed_kernel(native())
    gen = torch.Generator().manual_seed(4)
    noise = torch.randint(0, 256, (48, 5 * 18), dtype=torch.uint8, generator=gen)
    packed = cpu_quant.prepare_gguf_weight(noise, T)
    assert packed.shape == (3, 5, 16 * 18) and packed.dtype == torch.uint8
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, T), noise)
    assert torch.equal(packed, module.pack_weight(noise, ref.GGUF_TYPE_IDS["Q4_0"]))
    # Rows not a multiple of 16 keep the file's blocks (the row kernel's).
    assert cpu_quant.prepare_gguf_weight(noise[:40], T).dim() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_reference_and_row_kernel(dtype):
    """80 columns (5 groups: a partial column tile), K 96, 576 and 1536; rows over the few-row
    tiles, partial row tiles and a 240-row chunk boundary."""
    module = packed_kernel(native())
    gen = torch.Generator().manual_seed(5)
    for n, k in ((80, 96), (32, 576), (48, 1536)):
        raw = random_blocks(n, k, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, T)
        assert packed.dim() == 3 and packed.nbytes == raw.nbytes
        for m in (1, 3, 4, 7, 17) + ((250,) if k == 96 else ()):
            x = torch.randn(m, k, generator=gen).to(dtype)
            with nan_outputs():
                tiled = module.gguf_linear(x, packed, TID)
            check_kernel_output(tiled, x, raw, (n, k, m))
            rows = module.gguf_linear(x, raw, TID)
            assert ((tiled - rows).abs().max() / rows.abs().max()).item() < 1e-5
            for i in {0, m // 2, m - 1}:
                assert torch.equal(module.gguf_linear(x[i : i + 1], packed, TID)[0], tiled[i])
            bias = torch.randn(n, generator=gen)
            with nan_outputs():
                out = cpu_quant.gguf_linear(x, packed, T, bias)
                out32 = cpu_quant.gguf_linear(x, packed, T, bias, torch.float32)
            assert out.dtype == dtype and torch.equal(out.float(), (tiled + bias).to(dtype).float())
            assert out32.dtype == torch.float32 and torch.equal(out32, tiled + bias)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.gguf_linear(torch.randn(1, 64), packed, TID)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_op_is_the_two_ops_bit_for_bit(dtype):
    module = packed_kernel(native())
    if not module.has_packed_gated():
        pytest.skip("no gated tiled kernel here")
    from pagedserve.testing.target import select_target

    ops = select_target("cpu").ops
    silu_and_mul = ops.get("silu_and_mul")
    gated = cpu_quant.make_gguf_linear_silu_and_mul(cpu_quant.gguf_linear, silu_and_mul)
    gen = torch.Generator().manual_seed(6)
    for d in (16, 48):  # one and three column groups per half
        raw = random_blocks(2 * d, 576, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, T)
        for m in (1, 5, 17):
            x = torch.randn(m, 576, generator=gen).to(dtype)
            bias = torch.randn(2 * d, generator=gen)
            with nan_outputs():
                got = module.gguf_linear_silu_out(x, packed, TID, bias)
            want = silu_and_mul(module.gguf_linear_out(x, packed, TID, bias))
            assert got.shape == (m, d) and torch.equal(got, want)
            assert torch.equal(gated(x, packed, T), silu_and_mul(cpu_quant.gguf_linear(x, packed, T)))
            for i in {0, m - 1}:
                assert torch.equal(module.gguf_linear_silu_out(x[i : i + 1], packed, TID, bias)[0], got[i])


@pytest.mark.parametrize("other", ["Q8_0", "Q5_0", "Q4_0"])
def test_stacked_op_runs_iq4_nl_beside_other_types_in_one_call(other):
    """IQ4_NL [q; k] beside another 32-value type's v: one native call, each part's columns
    bit for bit its own op's; beside Q4_1 (fp16 activation sums, quantized apart) too."""
    module = packed_kernel(native())
    gen = torch.Generator().manual_seed(7)
    stacked = cpu_quant.make_gguf_linear_stacked(cpu_quant.gguf_linear)
    parts = [(T, 48), (other, 16), (T, 32)]
    raws = [random_blocks(n, 576, gen, t) for t, n in parts]
    weights = [cpu_quant.prepare_gguf_weight(r, t) for r, (t, _) in zip(raws, parts)]
    types = [t for t, _ in parts]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 576, generator=gen).to(dtype)
        bias = torch.randn(96, generator=gen)
        with nan_outputs():
            got = module.gguf_linear_multi_out(x, weights, [ref.GGUF_TYPE_IDS[t] for t in types], bias)
        assert torch.equal(got, stacked(x, weights, types, bias))
        at, want = 0, []
        for w, (t, n) in zip(weights, parts):
            want.append(cpu_quant.gguf_linear(x, w, t, bias[at : at + n]))
            at += n
        assert torch.equal(got, torch.cat(want, dim=-1))
    q41 = random_blocks(16, 576, gen, "Q4_1")
    mixed = [weights[0], cpu_quant.prepare_gguf_weight(q41, "Q4_1")]
    x = torch.randn(3, 576, generator=gen)
    y = stacked(x, mixed, [T, "Q4_1"])
    assert torch.equal(
        y, torch.cat([cpu_quant.gguf_linear(x, mixed[0], T), cpu_quant.gguf_linear(x, mixed[1], "Q4_1")], -1)
    )


def test_embedding_rows_come_from_the_repacked_weight():
    module = packed_kernel(native())
    gen = torch.Generator().manual_seed(8)
    raw = random_blocks(96, 576, gen)
    ids = torch.tensor([95, 0, 17, 17, 40, 3, 95, 64])
    w = GGUFWeight(T, raw, 576, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight, embed_op=cpu_quant.gguf_embedding)
    prepared = w.prepared()
    assert prepared.data is None and prepared.packed.dim() == 3 and prepared.embeds_prepared
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(prepared.embedding(ids, dtype), ref.dequantize_gguf(raw, T)[ids].to(dtype))
    assert torch.equal(module.unpack_rows(prepared.packed, TID, ids), raw[ids])


# --- capability, conformance, Triton ----------------------------------------------------------


def test_cpu_declares_the_capability_and_keeps_the_type():
    from pagedserve.platforms.ops import GGUF_EXTENDED, OP_CAPABILITIES, OpRegistry
    from pagedserve.testing.target import select_target

    cap = ref.gguf_type_capability(T)
    assert cap == "gguf_type:IQ4_NL" and cap in OP_CAPABILITIES
    plain = OpRegistry()
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    assert T not in gguf_kept_types(plain)  # the extended capability does not promise it
    native()
    ops = select_target("cpu").ops
    if not ops.has_capability("gguf_linear", GGUF_EXTENDED):
        pytest.skip("the CPU platform keeps the reference gguf_linear here (PAGEDSERVE_QUANT_CPU_KERNELS=0)")
    assert ops.has_capability("gguf_linear", cap) and T in gguf_kept_types(ops)


@pytest.mark.parametrize(
    "op", ["gguf_linear", "prepare_gguf_weight", "gguf_embedding", "gguf_linear_silu_and_mul", "gguf_linear_stacked"]
)
def test_cpu_conformance_cases(op):
    """The kit's IQ4_NL cases (rows 1..300, outputs that are and are not multiples of 16,
    with and without bias, float32 and bfloat16; mixes with other types) for the CPU's ops."""
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    if op not in target.overridden_ops():
        pytest.skip(f"the CPU platform keeps the reference {op} here")
    checks = [c for c in op_checks(target) if c.id.startswith(f"op:{op}[") and T in c.id]
    assert len(checks) >= 4
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


TRITON_SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from test_quant_gguf_iq4nl import random_blocks
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(9)
for m, n, k in ((1, 24, 64), (3, 40, 96)):
    raw = random_blocks(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen)
    out = gguf_linear_triton(x.to(dev), raw.to(dev), "IQ4_NL", b.to(dev)).cpu()
    want = ref.gguf_linear(x, raw, "IQ4_NL", b)
    err = ((out - want).norm() / want.norm()).item()
    assert err < 1e-5, (m, n, err)
print("ok")
"""


def test_triton_kernel_interpreted():
    pytest.importorskip("triton")
    run_triton_interpreted(TRITON_SCRIPT)


# --- a tiny Llama GGUF of IQ4_NL tensors ----------------------------------------------------

_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: Per layer, each projection's type: all IQ4_NL, then IQ4_NL beside Q8_0 (v) and Q5_0 (up).
LAYER_TYPES = (
    dict.fromkeys(_PARTS, T),
    dict(zip(_PARTS, (T, T, "Q8_0", T, T, "Q5_0", T))),
)
HIDDEN, INTER, HEADS, KV_HEADS = 128, 256, 4, 2


def write_iq4_nl_gguf(path, seed: int = 0):
    """A 2-layer Llama GGUF with LAYER_TYPES and a tied IQ4_NL embedding (its row count, the
    byte-level test vocabulary's, not a multiple of 16: the row kernel's)."""
    return write_tiny_llama_gguf(
        path,
        LAYER_TYPES,
        T,
        hidden=HIDDEN,
        inter=INTER,
        heads=HEADS,
        kv_heads=KV_HEADS,
        name="tiny iq4_nl llama",
        seed=seed,
    )


def test_iq4_nl_gguf_loads_kept_and_matches_the_dequantized_model(tmp_path):
    module = native()

    def check(model):
        layer0, layer1 = model.layers
        packed = module.has_packed()
        for w in (layer0.qkv, layer0.o, layer0.gate_up, layer0.down, layer1.o, layer1.down):
            assert isinstance(w, GGUFWeight) and w.type_name == T
            assert (w.packed is not None) == packed  # repacked at load where the tiled kernel is built
        # IQ4_NL beside Q8_0 / Q5_0: a StackedWeight, each part in its own type (one native call;
        # IQ4_NL is not widened to Q8_0, which would hold its values but nearly double its bytes).
        assert [p.type_name for p in layer1.qkv.parts] == [T, "Q8_0"]
        assert [p.type_name for p in layer1.gate_up.parts] == [T, "Q5_0"]
        head = model.lm_head
        assert isinstance(head, GGUFWeight) and head.type_name == T
        assert head.out_features % 16 and head.packed is None  # the vocabulary: the row kernel's

    check_kept_against_dequantized(write_iq4_nl_gguf(tmp_path / "iq4nl.gguf"), check, greedy=True)


def test_fuse_keeps_iq4_nl_in_its_own_blocks():
    gen = torch.Generator().manual_seed(10)

    def w(type_name: str, rows: int) -> GGUFWeight:
        return GGUFWeight(type_name, random_blocks(rows, 64, gen, type_name), 64, cpu_quant.gguf_linear)

    same = fuse([w(T, 32), w(T, 16)])
    assert isinstance(same, GGUFWeight) and same.type_name == T and same.out_features == 48
    for other in ("Q8_0", "Q4_0", "Q5_0"):
        parts = [w(T, 32), w(T, 16), w(other, 16)]
        fused = fuse(parts)
        assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == [T, other]
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
