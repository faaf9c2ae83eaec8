"""``gguf_linear_stacked``: a fused projection whose parts keep different GGUF block types
(a Q5_K_M's [q; k] Q5_1 beside a Q8_0 v) multiplied in one call.  The CPU's native call
(kernels/cpu/quant_gguf.cpp ``gguf_linear_multi_out``: activations quantized once, one
parallel region, each part writing its columns in place) gives bit for bit the parts'
``gguf_linear`` results side by side, at every row count and thread count (K-quant parts:
test_quant_gguf_kquant_fused.py); the op agrees
with the reference; a ``StackedWeight`` of such parts makes one call; the registry's
default is its own ``gguf_linear`` once per part."""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import quantize
from gguf_type_checks import check_multi_out_is_the_parts_side_by_side, counting_linear
from test_quant_kernels import random_gguf

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.platforms.ops import OpRegistry
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight


def _packed_kernel_available() -> bool:
    module = load_quant_kernels()
    return module is not None and module.has_packed()


needs_packed = pytest.mark.skipif(not _packed_kernel_available(), reason="no AVX-512 VNNI tiled GGUF kernel here")

#: Part types and row counts: column groups of unequal sizes, so that the threads' shares
#: end inside parts.
MIXES = [
    (("Q5_0", 48), ("Q8_0", 16)),
    (("Q5_1", 32), ("Q8_0", 48)),
    (("Q8_0", 16), ("Q4_0", 80), ("Q5_1", 16), ("Q5_0", 32)),
    (("Q4_1", 16), ("Q4_1", 32)),
    # Q4_1's activation sums are rounded to fp16: a second quantization in the same call.
    (("Q5_0", 32), ("Q4_1", 16), ("Q8_0", 16), ("Q4_1", 16)),
]


def _blocks(type_name, n, k, gen):
    if ref.GGUF_BLOCK_VALUES[type_name] == 256:  # K-quant blocks of random values, by the test quantizer
        x = torch.randn(n, k, generator=gen).numpy()
        return torch.from_numpy(quantize(x, type_name)).reshape(n, -1)
    return random_gguf(type_name, n, k, gen)


def _parts(mix, k, gen):
    blocks = [_blocks(t, n, k, gen) for t, n in mix]
    return blocks, [cpu_quant.prepare_gguf_weight(b, t) for b, (t, _) in zip(blocks, mix)]


@needs_packed
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(t for t, _ in m))
def test_native_call_is_the_parts_side_by_side(mix, dtype, threads):
    gen = torch.Generator().manual_seed(31)
    _, packed = _parts(mix, 96, gen)
    rows = (1, 2, 5, 7, 13, 16, 17, 64, 241, 300)
    check_multi_out_is_the_parts_side_by_side(packed, [t for t, _ in mix], gen, threads, (dtype,), rows)


@needs_packed
def test_native_call_refuses_what_it_cannot_take():
    gen = torch.Generator().manual_seed(32)
    module = load_quant_kernels()
    q80 = cpu_quant.prepare_gguf_weight(random_gguf("Q8_0", 16, 64, gen), "Q8_0")
    x = torch.randn(3, 64, generator=gen)
    ids = ref.GGUF_TYPE_IDS
    with pytest.raises(RuntimeError, match="packed"):
        module.gguf_linear_multi_out(x, [random_gguf("Q8_0", 16, 64, gen)], [ids["Q8_0"]])
    with pytest.raises(RuntimeError, match="bias"):
        module.gguf_linear_multi_out(x, [q80, q80], [ids["Q8_0"]] * 2, torch.zeros(31))


@needs_packed
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(t for t, _ in m))
def test_cpu_op_agrees_with_the_reference(mix):
    """Within the int8-activation error of ``gguf_linear`` (the conformance kit's 2.5e-2 of
    the output's scale), bias and float32 output included; each part exactly the CPU's
    own ``gguf_linear``."""
    gen = torch.Generator().manual_seed(33)
    k = 128
    blocks, packed = _parts(mix, k, gen)
    types = [t for t, _ in mix]
    op = cpu_quant.make_gguf_linear_stacked(cpu_quant.gguf_linear)
    bias = torch.randn(sum(n for _, n in mix), generator=gen)
    for m in (1, 9, 70):
        x = torch.randn(m, k, generator=gen).bfloat16()
        for out_dtype in (None, torch.float32):
            got = op(x, packed, types, bias, out_dtype)
            want = reference.gguf_linear_stacked(x, blocks, types, bias, out_dtype)
            assert got.dtype == want.dtype == (out_dtype or x.dtype)
            err = (got.float() - want.float()).abs().max() / want.float().abs().max()
            assert err.item() < 2.5e-2, (m, out_dtype, err)
            at = 0
            for w, t in zip(packed, types):
                n = w.numel() // ref.gguf_row_bytes(t, k)
                part = cpu_quant.gguf_linear(x, w, t, bias[at : at + n], out_dtype)
                assert torch.equal(got[:, at : at + n], part), (m, t)
                at += n


@needs_packed
def test_cpu_op_falls_back_per_part():
    """Parts the native call does not take (a weight of rows not a multiple of 16 left in
    the file's blocks, beside 32-value or K-quant parts) go through ``gguf_linear`` once per part."""
    gen = torch.Generator().manual_seed(34)
    k = 256
    linear, calls = counting_linear()
    op = cpu_quant.make_gguf_linear_stacked(linear)
    for mix in ((("Q5_0", 40), ("Q8_0", 16)), (("Q4_K", 24), ("Q6_K", 16))):
        blocks, packed = _parts(mix, k, gen)
        types = [t for t, _ in mix]
        x = torch.randn(4, k, generator=gen)
        calls.clear()
        got = op(x, packed, types)
        assert calls == types
        want = reference.gguf_linear_stacked(x, blocks, types)
        assert ((got - want).abs().max() / want.abs().max()).item() < 2.5e-2


def test_registry_default_is_its_gguf_linear_per_part():
    gen = torch.Generator().manual_seed(35)
    ops = OpRegistry()
    assert ops.source("gguf_linear_stacked") == "reference"
    blocks = [random_gguf("Q5_1", 32, 64, gen), random_gguf("Q8_0", 16, 64, gen)]
    x = torch.randn(3, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    got = ops.gguf_linear_stacked(x, blocks, ["Q5_1", "Q8_0"], bias)
    want = torch.cat(
        [
            reference.gguf_linear(x, blocks[0], "Q5_1", bias[:32]),
            reference.gguf_linear(x, blocks[1], "Q8_0", bias[32:]),
        ],
        dim=-1,
    )
    assert torch.equal(got, want)
    assert torch.equal(reference.gguf_linear_stacked(x, blocks, ["Q5_1", "Q8_0"], bias), want)


@needs_packed
def test_stacked_weight_makes_one_call():
    """A fused q/k/v of a Q5_1 [q; k] and a Q8_0 v (not one type: Q5_1's values are not
    Q8_0's) is a StackedWeight that, prepared, multiplies through the stacked op once."""
    gen = torch.Generator().manual_seed(36)
    k = 64
    calls = []
    native = cpu_quant.make_gguf_linear_stacked(cpu_quant.gguf_linear)

    def stacked(*args):
        calls.append(args[2])
        return native(*args)

    op, prepare = cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight
    parts = [
        GGUFWeight(t, random_gguf(t, n, k, gen), k, op, prepare, op_out_dtype=True, stacked_op=stacked)
        for t, n in (("Q5_1", 32), ("Q5_1", 16), ("Q8_0", 16))
    ]
    fused = GGUFWeight.concat(parts)
    assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == ["Q5_1", "Q8_0"]
    prepared = fused.prepared()
    x = torch.randn(5, k, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    for out_dtype in (None, torch.float32):
        calls.clear()
        got = prepared.apply(x, bias, out_dtype)
        assert calls == [["Q5_1", "Q8_0"]]
        sizes = [p.out_features for p in prepared.parts]
        want = torch.cat([p.apply(x, b, out_dtype) for p, b in zip(prepared.parts, bias.split(sizes))], dim=-1)
        assert torch.equal(got, want)
    # Without the op (another platform's parts), one call per part as before.
    plain = StackedWeight([GGUFWeight(p.type_name, None, k, op, packed=p.packed) for p in prepared.parts])
    calls.clear()
    assert torch.equal(plain.apply(x), torch.cat([p.apply(x) for p in prepared.parts], dim=-1)) and not calls
