"""The checks every GGUF block type kept on the CPU goes through, parameterised by the type
and what is particular to it (its random blocks, its K, its row counts); the per-type test
files (test_quant_gguf_kquants.py, _q2k.py, _q3k.py, _iq4nl.py, _iq4xs.py) are lists of
these calls plus what only their type has.

References: ``gguf.quants`` (an independent implementation) for the reference
dequantizer and the test quantizer's blocks; for the kernels the float64 product of the
activations rounded to int8 blocks as the kernels round them (float32 summation order
the only difference) and the float reference (the int8 activations' error, relative
2.5e-2, the ``gguf_linear`` allowance).  Kernel outputs are poisoned with NaN first
(:func:`nan_outputs`), so an element a kernel does not write fails the checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pytest
import torch
from gguf_blocks import quantize
from native_build import require_native

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.cpu.quant_native import load_quant_kernels, quant_build_spec
from pagedserve.models.layers import fuse
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, gguf_kept_types

#: ``random(n, k, gen)``: uint8 blocks ``[n, row bytes]`` of one type.
RandomBlocks = Callable[[int, int, torch.Generator], torch.Tensor]
#: A Llama layer's projections, as the GGUF names them.
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: Token ids a tied embedding gathers: out of order, repeated, first and last rows.
EMBED_IDS = (95, 0, 17, 17, 40, 3, 95, 64)


def native():
    return require_native(load_quant_kernels, quant_build_spec, "the quantized CPU kernels")


@contextlib.contextmanager
def nan_outputs() -> Iterator[None]:
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


def random_blocks(
    type_name: str,
    n: int,
    k: int,
    gen: torch.Generator,
    fields: Iterable[int] | None = None,
    size: float = 0.01,
    divisor: float | None = None,
) -> torch.Tensor:
    """uint8 [n, row bytes]: random bytes (every quant and sub-block scale bit pattern) with
    the fp16 fields at byte offsets ``fields`` of each block set to finite, realistic
    sizes ``(rand * size + 1e-3) / divisor``, drawn in that order.  Defaults: the Q5_x and
    K-quants' d (and dmin) fields, divided by 32 for the 256-value types."""
    bb, per = ref.GGUF_BLOCK_BYTES[type_name], ref.GGUF_BLOCK_VALUES[type_name]
    if fields is None:
        fields = [208] if type_name == "Q6_K" else [0, 2] if type_name != "Q5_0" else [0]
    if divisor is None:
        divisor = 32 if per == 256 else 1
    raw = torch.randint(0, 256, (n, k // per, bb), dtype=torch.uint8, generator=gen)
    for at in fields:
        scale = (torch.rand(n, k // per, generator=gen) * size + 1e-3) / divisor
        raw[..., at : at + 2] = scale.half().view(torch.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def int8_activation_reference(x: torch.Tensor, raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """x rounded as the kernels round it (int8 per 32 values, scale max|x|/127 rounded to
    fp16), times the dequantized weight, in float64: what the kernels compute exactly."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # A true division: ``127.0 / amax`` is reciprocal(amax) * 127 in torch, rounded otherwise.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    d = (amax / 127.0).half().float()
    xq = (q * d).reshape(x.shape)
    return (xq.double() @ ref.dequantize_gguf(raw, type_name).double().t()).float()


def check_kernel_output(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, type_name: str, what=None) -> None:
    """``got`` (a kernel's float32 x @ raw^T) every element written, within float32
    summation of the int8-activation product and within 2.5e-2 of the float reference."""
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), what
    exact = int8_activation_reference(x, raw, type_name)
    assert (got - exact).abs().max().item() <= 2e-5 * exact.abs().max().item(), what
    want = x.float() @ ref.dequantize_gguf(raw, type_name).t()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2.5e-2, (what, rel)


# --- the format ----------------------------------------------------------------------------


def check_dequantizer_against_gguf(raw: torch.Tensor, type_name: str, gen: torch.Generator) -> None:
    """The torch reference dequantizer equals ``gguf.quants`` on ``raw`` and on blocks of
    random bytes of its shape (fields of any sign and size; only NaN/inf values are left
    out of the comparison)."""
    import gguf

    mixed = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
    k = raw.shape[1] // ref.GGUF_BLOCK_BYTES[type_name] * ref.GGUF_BLOCK_VALUES[type_name]
    for data in (raw, mixed):
        with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in random fp16 fields
            want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[type_name])
        got = ref.dequantize_gguf(data, type_name)
        finite = np.isfinite(want)
        assert got.shape == want.shape == (raw.shape[0], k) and finite.mean() > 0.5
        np.testing.assert_array_equal(got.numpy()[finite], want[finite])


def quantizer_rows(k: int) -> np.ndarray:
    """float32 [5, k] Gaussian rows (std 0.1), row 1 offset by 0.2: minimums and signed
    scales matter."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, k)) * 0.1).astype(np.float32)
    x[1] += 0.2
    return x


def check_quantizer_reads_back(x: np.ndarray, type_name: str, max_error: float) -> np.ndarray:
    """The test quantizer's blocks of ``x`` have the type's row size, read back through
    ``gguf.quants`` within ``max_error`` (relative: the format's round to nearest) and
    through the reference dequantizer exactly as ``gguf.quants``; returns the values read."""
    import gguf

    raw = quantize(x, type_name)
    assert raw.shape == (x.shape[0], ref.gguf_row_bytes(type_name, x.shape[1])) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    err = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert err < max_error, err
    assert np.array_equal(ref.dequantize_gguf(torch.from_numpy(raw), type_name).numpy(), back)
    return back


# --- the native kernels --------------------------------------------------------------------


def check_row_kernel(
    type_name: str, random: RandomBlocks, dtype: torch.dtype, ks: Iterable[int], seed: int = 3
) -> torch.Generator:
    """The file's blocks (what rows not a multiple of 16 keep: 40 and 24 rows) through the
    row kernel at each K of ``ks`` and 1, 3, 17 and 64 rows, outputs poisoned: against the
    references; the registered op with a bias the same numbers in x's dtype; a row alone
    the same bits as among others.  Returns the generator, for more cases."""
    module, tid = native(), ref.GGUF_TYPE_IDS[type_name]
    gen = torch.Generator().manual_seed(seed)
    with nan_outputs():
        for k in ks:
            for m in (1, 3, 17, 64):
                n = 40 if m != 17 else 24
                raw = random(n, k, gen)
                assert cpu_quant.prepare_gguf_weight(raw, type_name) is raw
                x = torch.randn(m, k, generator=gen).to(dtype)
                got = module.gguf_linear(x, raw, tid)
                check_kernel_output(got, x, raw, type_name, (k, m))
                bias = torch.randn(n, generator=gen)
                y = cpu_quant.gguf_linear(x, raw, type_name, bias)
                assert y.dtype == dtype
                assert torch.equal(y.float(), (got + bias).to(dtype).float()), (k, m)
                for i in {0, m - 1}:
                    assert torch.equal(module.gguf_linear(x[i : i + 1], raw, tid)[0], got[i]), (k, m, i)
        whole = module.gguf_linear(x, raw, tid)
        for i in (0, 8, 16):
            assert torch.equal(module.gguf_linear(x[i : i + 1], raw, tid)[0], whole[i])
    return gen


def check_bad_shapes_are_refused(type_name: str, short_bytes: int, k_bytes: int | None = None) -> None:
    """A K not a multiple of the 256-value block (rows of ``k_bytes``, one block's by
    default) and rows of ``short_bytes`` are refused; rows not a multiple of 16 keep the
    file's blocks (the row kernel's)."""
    module, tid = native(), ref.GGUF_TYPE_IDS[type_name]
    bb = ref.GGUF_BLOCK_BYTES[type_name]
    raw = torch.zeros(4, 2 * bb, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        module.gguf_linear(torch.randn(1, 224), raw[:, : k_bytes or bb], tid)
    with pytest.raises(RuntimeError, match="bytes"):
        module.gguf_linear(torch.randn(1, 256), raw[:, :short_bytes], tid)
    odd = torch.zeros(24, bb, dtype=torch.uint8)
    assert cpu_quant.prepare_gguf_weight(odd, type_name) is odd


def tiled_module(type_name: str):
    """The kernels, where this build has the tiled (AVX-512 VNNI) kernel of ``type_name``;
    else the test is skipped."""
    module = native()
    kpacked = type_name in cpu_quant.KPACKED_TYPES
    if not module.has_packed() or (kpacked and not module.has_kpacked(ref.GGUF_TYPE_IDS[type_name])):
        pytest.skip(f"no AVX-512 VNNI tiled {type_name if kpacked else 'GGUF'} kernel here")
    return module


def check_repacking_is_lossless(type_name: str, gen: torch.Generator, blocks: int = 3) -> torch.Tensor:
    """Blocks of random bytes (any scale, any bit pattern), 48 rows of ``blocks`` blocks,
    repack into the file's size and back (torch's inverse, and the native gather of rows in
    any order); a row out of range is refused.  Returns the packed weight."""
    module, tid = tiled_module(type_name), ref.GGUF_TYPE_IDS[type_name]
    bb = ref.GGUF_BLOCK_BYTES[type_name]
    noise = torch.randint(0, 256, (48, blocks * bb), dtype=torch.uint8, generator=gen)
    packed = cpu_quant.prepare_gguf_weight(noise, type_name)
    assert packed.shape == (3, blocks, 16 * bb) and packed.dtype == torch.uint8 and packed.nbytes == noise.nbytes
    assert torch.equal(cpu_quant.unpack_gguf_weight(packed, type_name), noise)
    ids = torch.tensor([47, 0, 16, 16, 5, 31])
    assert torch.equal(module.unpack_rows(packed, tid, ids), noise[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        module.unpack_rows(packed, tid, torch.tensor([48]))
    return packed


def check_tiled_kernel(
    type_name: str,
    random: RandomBlocks,
    gen: torch.Generator,
    dtypes: Iterable[torch.dtype],
    shapes: Iterable[tuple[int, int]],
    rows: Iterable[int] = (1, 3, 4, 7, 17),
    first_shape_rows: Iterable[int] = (),
    wrong_k: int = 512,
) -> torch.Tensor:
    """The tiled kernel on blocks repacked at load, for each (n, k) of ``shapes`` (n not a
    multiple of 16 columns groups: a partial column tile), each dtype and row count (and
    ``first_shape_rows`` more on the first shape: past a 240-row chunk), outputs poisoned:
    against the references; the row kernel's result to float32 summation order; a row
    alone the same bits as among others; the registered op with a bias in x's dtype and in
    float32 the same numbers.  A K the packed weight does not hold is refused.  Returns
    the last packed weight."""
    module, tid = tiled_module(type_name), ref.GGUF_TYPE_IDS[type_name]
    dtypes, rows, first_shape_rows = tuple(dtypes), tuple(rows), tuple(first_shape_rows)
    for at, (n, k) in enumerate(shapes):
        raw = random(n, k, gen)
        packed = cpu_quant.prepare_gguf_weight(raw, type_name)
        assert packed.dim() == 3 and packed.nbytes == raw.nbytes
        for dtype in dtypes:
            for m in rows + (first_shape_rows if at == 0 else ()):
                x = torch.randn(m, k, generator=gen).to(dtype)
                with nan_outputs():
                    tiled = module.gguf_linear(x, packed, tid)
                    by_rows = module.gguf_linear(x, raw, tid)
                check_kernel_output(tiled, x, raw, type_name, (n, k, m, dtype))
                assert ((tiled - by_rows).abs().max() / by_rows.abs().max()).item() < 1e-5
                for i in {0, m // 2, m - 1}:
                    assert torch.equal(module.gguf_linear(x[i : i + 1], packed, tid)[0], tiled[i]), (n, k, m, i)
                bias = torch.randn(n, generator=gen)
                with nan_outputs():
                    out = cpu_quant.gguf_linear(x, packed, type_name, bias)
                    out32 = cpu_quant.gguf_linear(x, packed, type_name, bias, torch.float32)
                assert out.dtype == dtype and out32.dtype == torch.float32
                assert torch.equal(out.float(), (tiled + bias).to(dtype).float()), (n, k, m)
                assert torch.equal(out32, tiled + bias), (n, k, m)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.gguf_linear(torch.randn(1, wrong_k), packed, tid)
    return packed


def counting_linear() -> tuple[Callable[..., torch.Tensor], list[str]]:
    """The CPU's ``gguf_linear``, and the list of the types it was called with."""
    calls: list[str] = []

    def linear(x, d, t, b=None, out_dtype=None):
        calls.append(t)
        return cpu_quant.gguf_linear(x, d, t, b, out_dtype)

    return linear, calls


def cpu_silu_and_mul():
    """The silu_and_mul the CPU registry runs next to the quantized kernels."""
    from pagedserve.testing.target import select_target

    return select_target("cpu").ops.get("silu_and_mul")


def check_gated_op_is_the_two_ops(packed: torch.Tensor, type_name: str, x: torch.Tensor) -> None:
    """The registered gated op on a repacked [gate; up] weight is bit for bit the two ops
    in sequence, and one native call (the linear op not called) where the build has the
    type's gated tiles."""
    silu_and_mul = cpu_silu_and_mul()
    linear, calls = counting_linear()
    gated = cpu_quant.make_gguf_linear_silu_and_mul(linear, silu_and_mul)
    assert torch.equal(gated(x, packed, type_name), silu_and_mul(cpu_quant.gguf_linear(x, packed, type_name)))
    assert calls == ([] if native().has_kpacked_gated(ref.GGUF_TYPE_IDS[type_name]) else [type_name])


def parts_side_by_side(x: torch.Tensor, weights, types, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each part's own ``gguf_linear`` (with its slice of ``bias``), side by side."""
    at, outs = 0, []
    for w, t in zip(weights, types, strict=True):
        n = w.shape[0] * 16 if w.dim() == 3 else w.shape[0]
        outs.append(cpu_quant.gguf_linear(x, w, t, None if bias is None else bias[at : at + n]))
        at += n
    return torch.cat(outs, dim=-1)


def check_multi_out_is_the_parts_side_by_side(
    packed: list[torch.Tensor],
    types: list[str],
    gen: torch.Generator,
    threads: int,
    dtypes: Iterable[torch.dtype],
    rows: Iterable[int],
    float32_out_of_float32: bool = True,
) -> None:
    """``gguf_linear_multi_out`` on repacked parts (column groups of unequal sizes, so that
    threads' shares end inside parts) is bit for bit each part's ``gguf_linear_out`` side
    by side, at ``threads`` threads, each dtype and row count, with and without a bias,
    rounded to x's dtype and in float32 (from bfloat16 activations; from float32 ones too
    where ``float32_out_of_float32``); the output poisoned first."""
    module = native()
    ids = [ref.GGUF_TYPE_IDS[t] for t in types]
    sizes = [w.shape[0] * 16 for w in packed]
    k = packed[0].shape[1] * ref.GGUF_BLOCK_VALUES[types[0]]
    bias = torch.randn(sum(sizes), generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in dtypes:
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(dtype)
                for b in (None, bias):
                    for f32 in (False, True) if float32_out_of_float32 or dtype == torch.bfloat16 else (False,):
                        slices = [None] * len(packed) if b is None else list(b.split(sizes))
                        want = torch.cat(
                            [module.gguf_linear_out(x, w, t, s, f32) for w, t, s in zip(packed, ids, slices)], dim=-1
                        )
                        with nan_outputs():
                            got = module.gguf_linear_multi_out(x, packed, ids, b, f32)
                        assert got.dtype == want.dtype and torch.equal(got, want), (dtype, m, b is None, f32)
    finally:
        torch.set_num_threads(before)


def check_embedding_rows_from_the_repacked_weight(type_name: str, raw: torch.Tensor) -> GGUFWeight:
    """A tied embedding reads its rows from the LM head's repacked form: the file's rows
    dequantized exactly (repeated and out-of-order ids), and the native row gather the
    file's bytes.  Returns the weight, unprepared."""
    module = tiled_module(type_name)
    ids = torch.tensor(EMBED_IDS)
    k = raw.shape[1] // ref.GGUF_BLOCK_BYTES[type_name] * ref.GGUF_BLOCK_VALUES[type_name]
    w = GGUFWeight(
        type_name, raw, k, cpu_quant.gguf_linear, cpu_quant.prepare_gguf_weight, embed_op=cpu_quant.gguf_embedding
    )
    prepared = w.prepared()
    assert prepared.data is None and prepared.packed.dim() == 3 and prepared.embeds_prepared
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize_gguf(raw, type_name)[ids].to(dtype)
        assert torch.equal(prepared.embedding(ids, dtype), want)
        assert torch.equal(w.embedding(ids, dtype), want)
    assert torch.equal(module.unpack_rows(prepared.packed, ref.GGUF_TYPE_IDS[type_name], ids), raw[ids])
    return w


# --- capability and conformance --------------------------------------------------------------


def check_cpu_declares_the_type(type_name: str) -> None:
    """An optional type is kept only by a ``gguf_linear`` that declares its
    ``gguf_type:NAME`` (not by the reference, nor by one declaring the extended types
    only); the CPU's declares it where it runs its own kernels."""
    from pagedserve.platforms.ops import GGUF_EXTENDED, OP_CAPABILITIES, OpRegistry
    from pagedserve.testing.target import select_target

    cap = ref.gguf_type_capability(type_name)
    assert cap == f"gguf_type:{type_name}" and cap in OP_CAPABILITIES and type_name in ref.GGUF_OPTIONAL_TYPES
    plain = OpRegistry()
    assert type_name not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(GGUF_EXTENDED,))
    assert type_name not in gguf_kept_types(plain)
    plain.register("gguf_linear", cpu_quant.gguf_linear, source="test", capabilities=(cap,))
    assert type_name in gguf_kept_types(plain)
    native()
    ops = select_target("cpu").ops
    if not ops.has_capability("gguf_linear", GGUF_EXTENDED):
        pytest.skip("the CPU platform keeps the reference gguf_linear here (PAGEDSERVE_QUANT_CPU_KERNELS=0)")
    assert ops.has_capability("gguf_linear", cap) and type_name in gguf_kept_types(ops)


def check_conformance_cases(op: str, type_name: str, at_least: int) -> None:
    """The conformance kit's cases of ``op`` with ``type_name`` in them (at least
    ``at_least``) pass on the CPU's own op."""
    from pagedserve.testing.op_suite import op_checks
    from pagedserve.testing.target import select_target

    native()
    target = select_target("cpu")
    if op not in target.overridden_ops():
        pytest.skip(f"the CPU platform keeps the reference {op} here")
    checks = [c for c in op_checks(target) if c.id.startswith(f"op:{op}[") and type_name in c.id]
    assert len(checks) >= at_least, [c.id for c in checks]
    failed = [f"{r.id}: {r.message}" for r in (c.run() for c in checks) if r.status != "passed"]
    assert not failed, "\n".join(failed)


def triton_script(type_name: str, random: str, seed: int, cases: Iterable[tuple[int, int, int]]) -> str:
    """A script for ``gguf_blocks.run_triton_interpreted``: the Triton kernel on blocks of
    ``random`` ("module:function", called ``(n, k, gen)``) for each (m, n, k) of ``cases``,
    with a bias, within float32 rounding of the reference."""
    module, function = random.split(":")
    return f"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from {module} import {function} as random_blocks
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed({seed})
for m, n, k in {tuple(cases)!r}:
    raw = random_blocks(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen)
    out = gguf_linear_triton(x.to(dev), raw.to(dev), {type_name!r}, b.to(dev)).cpu()
    want = ref.gguf_linear(x, raw, {type_name!r}, b)
    err = ((out - want).norm() / want.norm()).item()
    assert err < 1e-5, (m, n, k, err)
print("ok")
"""


# --- weights and models ------------------------------------------------------------------


def projections(default: str, **types: str) -> dict[str, str]:
    """One layer's projection types (for ``write_tiny_llama_gguf``): ``default`` but for
    the parts named in ``types``."""
    assert set(types) <= set(PARTS), types
    return {part: types.get(part, default) for part in PARTS}


def check_fuse_keeps_the_type(type_name: str, random, k: int, others: Iterable[str], gen: torch.Generator) -> None:
    """Parts of ``type_name`` fuse into one weight of it; beside a part of each of
    ``others`` (``random(rows, k, gen, type)`` blocks), into a StackedWeight of runs of one
    type holding exactly the parts' values."""

    def w(t: str, rows: int) -> GGUFWeight:
        return GGUFWeight(t, random(rows, k, gen, t), k, cpu_quant.gguf_linear)

    same = fuse([w(type_name, 32), w(type_name, 16)])
    assert isinstance(same, GGUFWeight) and same.type_name == type_name and same.out_features == 48
    for other in others:
        parts = [w(type_name, 32), w(type_name, 16), w(other, 16)]
        fused = fuse(parts)
        assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == [type_name, other]
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def check_kept_whole(layer, type_name: str) -> None:
    """Each of a model layer's linear weights (qkv, o, gate_up, down) one weight of
    ``type_name``, repacked at load exactly where this build has the type's tiled kernel."""
    module = native()
    kpacked = type_name in cpu_quant.KPACKED_TYPES
    tiled = module.has_packed() and (not kpacked or module.has_kpacked(ref.GGUF_TYPE_IDS[type_name]))
    for field in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, field)
        assert isinstance(w, GGUFWeight) and w.type_name == type_name, field
        assert (w.packed is not None) == tiled, field
        assert w.packed is None or w.packed.dim() == 3, field


def check_stacked(w, types: list[str]) -> None:
    """``w`` a StackedWeight of runs of one type each, of ``types`` in order."""
    assert isinstance(w, StackedWeight) and [p.type_name for p in w.parts] == types


def _with_reference_op(w):
    """``w`` (a model's linear weight) with each GGUF part multiplying through the float
    reference instead of the registry's kernel (repacked parts unpacked first)."""
    from pagedserve.kernels import reference

    if isinstance(w, StackedWeight):
        return StackedWeight([_with_reference_op(p) for p in w.parts])
    if not isinstance(w, GGUFWeight):
        return w
    data = w.data if w.packed is None else cpu_quant.unpack_gguf_weight(w.packed, w.type_name)
    return GGUFWeight(w.type_name, data, w.in_features, reference.gguf_linear)


def check_kept_against_dequantized(path, check_model, greedy: bool = False) -> None:
    """The GGUF at ``path`` loaded dequantized (``quantization="none"``: the loader's
    gguf.quants, float linears) and kept (``quantization="gguf"``): ``check_model(model)``
    asserts what the kept model holds; then its logprobs are within the int8-activation
    error of the dequantized model's (the mixed-type model measures max |dlogprob| 0.13,
    and 0.125 for the same model stored all Q8_0, against logprobs of mean -6.9 and
    standard deviation 1.8), ``greedy`` generates a few tokens, and with every kept weight
    multiplying through the float reference (rows, block layouts and fusions all in place)
    the model gives the dequantized model's numbers."""
    from test_quant_support import sequence_logprobs

    from pagedserve import LLM, SamplingParams

    kw = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    ids = list(range(3, 60))
    want = sequence_logprobs(LLM(model=str(path), quantization="none", **kw), ids)
    kept = LLM(model=str(path), quantization="gguf", **kw)
    model = kept.llm_engine.runner.model
    check_model(model)
    got = sequence_logprobs(kept, ids)
    assert torch.isfinite(got).all()
    diff = (got - want).abs()
    assert diff.max().item() < 0.3 and diff.mean().item() < 0.08, (diff.max().item(), diff.mean().item())
    if greedy:
        out = kept.generate([ids[:8]], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 4
    for layer in model.layers:
        for field in ("qkv", "o", "gate_up", "down"):
            setattr(layer, field, _with_reference_op(getattr(layer, field)))
    model.lm_head = _with_reference_op(model.lm_head)
    exact = sequence_logprobs(kept, ids)
    assert (exact - want).abs().max().item() < 1e-3, (exact - want).abs().max().item()
