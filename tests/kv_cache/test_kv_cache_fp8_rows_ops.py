"""fp8 KV caches with a scale per token and KV head (kv_cache_scales "row", the default
for kv_cache_dtype fp8_e4m3 / fp8_e5m2) at the op level.

A row is ``head_size`` fp8 values followed by the 4 bytes of a float32 scale
(``absmax / the format's largest finite value``, computed on write;
kernels/reference.py ``quantize_kv_rows``), the layout int8 rows have.  The write
(reference and native) stores exactly those bytes; every CPU attention implementation
(the native kernel with each runnable instruction set, the AMX candidates, sdpa, the
tuned op) matches the reference on the dequantized float32 cache; rows with outliers far
beyond e4m3's range keep their precision where scale 1.0 saturates; the conformance
kit's cases pass on the CPU platform and catch an attention that ignores the scales.
Fresh random inputs, outputs poisoned with NaN, blocks no sequence owns given NaN
scales, block tables with random ids in their unused columns.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from native_build import native_build_failed

from pagedserve.executor.model_runner import kv_bytes_per_block, kv_row_size
from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu import NativeCpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu.native import dequantized_blocks
from pagedserve.kv_cache import kv_dtype
from pagedserve.platforms.cpu.attention_ops import attention_candidates
from pagedserve.platforms.cpu.tuned_attention import TunedAttention
from pagedserve.platforms.cpu.tuning import Tuner
from tests.kernels.test_cpu_kernels import assert_close, make_batch, runnable_isas

pytestmark = pytest.mark.timeout(600)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
# (q_len, seq_len): decodes, a whole prompt, prefix-cache continuations, block edges.
SEQS = [(1, 37), (23, 23), (20, 150), (1, 300), (16, 64), (1, 1), (5, 48)]
NAN_SCALE = torch.tensor([float("nan")])


@pytest.fixture(scope="module")
def every_isa() -> dict[str, NativeCpuKernels]:
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(mod)}


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rows_cache(values: torch.Tensor, kv: torch.dtype, head_major: bool) -> torch.Tensor:
    """``values [blocks, block_size, kv_heads, d]`` quantized into a row-scaled ``kv`` cache
    ``[..., d + 4]`` (head-major storage like the CPU platform's, or token-major)."""
    nb, bs, kvh, d = values.shape
    if head_major:
        cache = torch.empty(nb, kvh, bs, d + 4, dtype=kv).transpose(1, 2)
    else:
        cache = torch.empty(nb, bs, kvh, d + 4, dtype=kv)
    cache.view(torch.uint8).copy_(reference.quantize_kv_rows(values, kv).view(torch.uint8))
    return cache


def rows_batch(seqs, heads, head_size, block_size, dtype, kv, gen, head_major=True, key_scale=4.0):
    """make_batch's inputs with row-scaled fp8 caches (keys spread wider than values, some
    rows with an outlier channel; values beyond e4m3's range are in the format tests: here
    they would make the scores too ill-conditioned for float32 tolerances) and every block
    no sequence reads given NaN scales."""
    q, kc, vc, tables, seq_lens, qsl = make_batch(seqs, *heads, head_size, block_size, torch.float32, gen)
    kc = kc * key_scale
    kc[::3, :, :, 0] *= 8.0  # an outlier channel: it grows its own row's scale only
    kc, vc = rows_cache(kc, kv, head_major), rows_cache(vc, kv, head_major)
    owned = set()
    for i, ctx in enumerate(seq_lens.tolist()):
        owned.update(tables[i, : (ctx + block_size - 1) // block_size].tolist())
    for b in range(kc.shape[0]):
        if b not in owned:
            kc[b, ..., head_size:] = NAN_SCALE.view(kv)
            vc[b, ..., head_size:] = NAN_SCALE.view(kv)
    return q.to(dtype), kc, vc, tables, seq_lens, qsl


def dequantized(cache: torch.Tensor) -> torch.Tensor:
    return reference.dequantize_kv(cache, cache.shape[-1] - 4)


def expected_attention(args, **extra) -> torch.Tensor:
    """The reference on float32 copies of everything (the caches dequantized)."""
    q, kc, vc, *meta = args
    return reference.paged_attention(q.float(), dequantized(kc), dequantized(vc), *meta, q.shape[-1] ** -0.5, **extra)


# ---- the format -----------------------------------------------------------------------


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
def test_quantize_kv_rows_hold_values_then_their_scale(kv):
    top = torch.finfo(kv).max
    gen = gen_for("format", kv)
    x = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 50
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 5] = 1e5  # one outlier, beyond both formats' range: it sets its row's scale only (below)
    rows = reference.quantize_kv_rows(x, kv)
    assert rows.dtype == kv and rows.shape == (300, 3, 68)
    q, s = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / top)
    # The float32 quotient x / s cast with round to nearest even, within [-top, top].
    want = torch.where(s > 0, x / s, torch.zeros_like(x)).clamp(-top, top).to(kv)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().amax(-1)[s.squeeze(-1) > 0].eq(top).all(), "each row's absmax maps to the top value"
    back = reference.dequantize_kv(rows, 64)
    assert torch.equal(back, q.float() * s)
    mant = 3 if kv == torch.float8_e4m3fn else 2
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert back[1, 1, 5] == pytest.approx(1e5, rel=2.0 ** -(mant + 1))
    # Relative error of each normal value: half an ulp of its mantissa.
    normal = back.abs() >= s * 2.0 ** (-6 if kv == torch.float8_e4m3fn else -14)
    err = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal & (x != 0)]
    assert err.max() <= 2.0 ** -(mant + 1) * (1 + 1e-5)


def test_row_scales_do_not_saturate_where_scale_one_does():
    """The motivation: a key of 5000 is stored as 448 at scale 1.0 (e4m3), within half an
    ulp with its row's scale."""
    x = torch.randn(8, 64, generator=gen_for("sat"))
    x[:, 3] = 5000.0
    unscaled = reference.quantize_kv(x, torch.float8_e4m3fn).float()
    assert unscaled[:, 3].eq(448.0).all()
    scaled = reference.dequantize_kv(reference.quantize_kv_rows(x, torch.float8_e4m3fn), 64)
    assert (scaled[:, 3] - 5000.0).abs().max() <= 5000.0 / 16


def test_row_sizes_and_layout_detection():
    assert kv_dtype.KV_SCALE_BYTES == reference.KV_SCALE_BYTES == 4
    for d in (64, 128):
        for t, name in ((torch.float8_e4m3fn, "float8_e4m3fn"), (torch.float8_e5m2, "float8_e5m2")):
            assert kv_row_size(d, t) == reference.kv_row_size(d, t) == kv_dtype.kv_row_size(d, name) == d + 4
            assert kv_row_size(d, t, False) == reference.kv_row_size(d, t, False) == d
            assert reference.kv_rows_scaled(torch.empty(2, 16, 1, d + 4, dtype=t), d)
            assert not reference.kv_rows_scaled(torch.empty(2, 16, 1, d, dtype=t), d)
        assert kv_row_size(d, torch.int8) == d + 4
        assert kv_row_size(d, torch.bfloat16) == kv_row_size(d, torch.bfloat16, True) == d
    with pytest.raises(ValueError, match="always carries a scale"):
        reference.kv_row_size(64, torch.int8, False)
    with pytest.raises(ValueError, match="head_size \\+ 4 = 68"):
        reference.kv_rows_scaled(torch.empty(2, 16, 1, 64, dtype=torch.int8), 64)
    # Rows with their scales: 2 d / (d + 4) the blocks of a bf16 cache; without: 2x.
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=64)
    bf16 = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn) == bf16 * 68 // 128
    assert kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn, False) == bf16 // 2


def test_resolve_kv_scales_modes():
    scales = {0: (0.5, 0.25)}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        assert kv_dtype.resolve_kv_scales("auto", name, None) == (True, None)
        assert kv_dtype.resolve_kv_scales("auto", name, scales) == (False, scales)
        assert kv_dtype.resolve_kv_scales("row", name, scales) == (True, None)
        assert kv_dtype.resolve_kv_scales("tensor", name, None) == (False, None)
        assert kv_dtype.resolve_kv_scales("tensor", name, scales) == (False, scales)
    assert kv_dtype.resolve_kv_scales("auto", "int8", scales) == (True, None)
    assert kv_dtype.resolve_kv_scales("tensor", "bfloat16", scales) == (False, None)


# ---- the cache write ------------------------------------------------------------------


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reshape_and_cache_writes_values_and_scales(every_isa, kv, head_major, dtype):
    gen = gen_for("write", kv, head_major, dtype)
    blocks, bs, kvh, d = 9, 16, 2, 64
    shape = (blocks, kvh, bs, d + 4) if head_major else (blocks, bs, kvh, d + 4)
    # Caches full of random bytes: a slot not written must keep its bytes.
    init = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(kv)
    if head_major:
        init = init.transpose(1, 2)
    n = 40
    key = (torch.randn(n, kvh, d, generator=gen) * 50).to(dtype)
    key[::4, 0, 7] = 3e4  # outliers
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[5] = -1  # padding: not written
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    manual = init.clone().view(torch.uint8)
    for t in range(n):
        if slots[t] >= 0:
            manual[slots[t] // bs, slots[t] % bs] = reference.quantize_kv_rows(key[t], kv).view(torch.uint8)
    assert torch.equal(want_k.view(torch.uint8), manual)
    for isa, kernels in every_isa.items():
        kc, vc = init.clone(), init.clone()
        if head_major:
            assert kc.stride(1) < kc.stride(2)
        kernels.reshape_and_cache(key, value, kc, vc, slots)
        assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8)), isa
        assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8)), isa


# ---- attention ------------------------------------------------------------------------


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize(
    "head_size,heads", [(64, (4, 4)), (64, (8, 2)), (128, (8, 2))], ids=["d64-mha", "d64-gqa4", "d128-gqa4"]
)
def test_native_attention_reads_fp8_rows(every_isa, kv, dtype, head_size, heads):
    gen = gen_for("attn", kv, dtype, head_size, heads)
    args = rows_batch(SEQS, heads, head_size, 16, dtype, kv, gen)
    expected = expected_attention(args)
    scale = head_size**-0.5
    ref = reference.paged_attention(*args, scale, torch.full_like(args[0], float("nan")))
    assert_close(ref, expected, dtype, "reference on the fp8 rows")
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out) is out
        assert_close(out, expected, dtype, f"{isa} {kv}")


@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 7}, {"sliding_window": 33, "soft_cap": 4.0}, {"soft_cap": 2.5}],
    ids=["w7", "w33-cap", "cap"],
)
def test_native_attention_fp8_rows_window_soft_cap_and_slid_out_blocks(every_isa, extra):
    """Slid-out table entries point at a block with NaN scales, which must never be read."""
    gen = gen_for("window", repr(extra))
    q, kc, vc, tables, seq_lens, qsl = rows_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, torch.float8_e4m3fn, gen)
    nan_block = int(dequantized(kc).flatten(1).isnan().all(1).nonzero()[0])
    window = extra.get("sliding_window")
    if window is not None:
        for i, ctx in enumerate(seq_lens.tolist()):
            q_len = int(qsl[i + 1] - qsl[i])
            first = max(0, ctx - q_len - window + 1) // 16
            tables[i, :first] = nan_block
    args = (q, kc, vc, tables, seq_lens, qsl)
    expected = expected_attention(args, **extra)
    assert not expected.isnan().any()
    for isa, kernels in every_isa.items():
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(*args, 64**-0.5, out, **extra)
        assert_close(out, expected, torch.bfloat16, f"{isa} {extra}")


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
def test_every_cpu_attention_candidate_reads_fp8_rows(every_isa, kv):
    kernels = next(iter(every_isa.values()))
    candidates = attention_candidates(kernels)
    gen = gen_for("candidates", kv)
    args = rows_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, kv, gen)
    expected = expected_attention(args)
    # The tuned op must route an 8-bit cache away from the timed (bf16) candidates.
    tuned = TunedAttention(Tuner(None), {"sdpa": candidates["sdpa"]}, static=kernels.paged_attention)
    fns = dict(candidates, tuned=tuned.op())
    for name, fn in fns.items():
        out = torch.full_like(args[0], float("nan"))
        fn(*args, 64**-0.5, out)
        assert_close(out, expected, torch.bfloat16, f"{name} {kv}")
    assert tuned.plans == {}, "an fp8 cache was timed on the bf16 candidates"


@pytest.mark.parametrize("kv", FP8, ids=FP8_IDS)
def test_avx512_kernels_read_fp8_rows_without_dequantizing(every_isa, monkeypatch, kv):
    """AVX-512 reads fp8 rows and their scales in registers (float32 and bf16 queries);
    the other instruction sets and float16 queries run on the dequantized blocks."""
    import pagedserve.kernels.cpu.native as native_mod

    with_kv8 = {isa: k for isa, k in every_isa.items() if k.has_kv8_attention}
    assert set(with_kv8) == {i for i in every_isa if i.startswith("avx512")}
    # Keys spread less than elsewhere: this checks the path, at float32's tolerance.
    args = rows_batch(SEQS, (8, 2), 64, 16, torch.bfloat16, kv, gen_for("no-dequant", kv), key_scale=2.0)
    expected = expected_attention(args)

    def forbidden(*_a, **_k):
        raise AssertionError("the blocks were dequantized")

    monkeypatch.setattr(native_mod, "dequantized_blocks", forbidden)
    for isa, kernels in with_kv8.items():
        for q in (args[0], args[0].float()):
            out = torch.full_like(q, float("nan"))
            kernels.paged_attention(q, *args[1:], 64**-0.5, out)
            assert_close(out, expected, q.dtype, f"{isa} {q.dtype}")
    monkeypatch.undo()
    called = []
    real = native_mod.dequantized_blocks
    monkeypatch.setattr(native_mod, "dequantized_blocks", lambda *a: called.append(1) or real(*a))
    q16 = args[0].to(torch.float16)
    out = torch.full_like(q16, float("nan"))
    next(iter(every_isa.values())).paged_attention(q16, *args[1:], 64**-0.5, out)
    assert_close(out, expected, torch.float16, "float16 query")
    assert called, "a float16 query has no in-register fp8 kernel: its blocks are dequantized"


def test_dequantized_blocks_applies_the_fp8_row_scales():
    gen = gen_for("dequant")
    q, kc, vc, tables, seq_lens, qsl = rows_batch(SEQS, (4, 2), 64, 16, torch.float32, torch.float8_e5m2, gen)
    k2, v2, t2 = dequantized_blocks(kc, vc, tables, seq_lens, torch.float32, 64)
    read = {b for i, ctx in enumerate(seq_lens.tolist()) for b in tables[i, : (ctx + 15) // 16].tolist()}
    assert k2.shape == (len(read), 16, 2, 64) and k2.dtype == torch.float32
    assert k2.stride(1) < k2.stride(2), "the head-major layout is kept"
    assert not k2.isnan().any() and not v2.isnan().any()
    for i, ctx in enumerate(seq_lens.tolist()):
        for j in range((ctx + 15) // 16):
            assert torch.equal(k2[t2[i, j]], dequantized(kc[tables[i, j]]))
            assert torch.equal(v2[t2[i, j]], dequantized(vc[tables[i, j]]))


def test_copy_and_swap_blocks_move_values_and_scales():
    gen = gen_for("copy")
    kv = torch.float8_e4m3fn
    src = torch.randint(0, 256, (6, 2, 16, 68), generator=gen, dtype=torch.uint8).view(kv).transpose(1, 2)
    dst = torch.randint(0, 256, (5, 2, 16, 68), generator=gen, dtype=torch.uint8).view(kv).transpose(1, 2)
    before = dst.clone()
    reference.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 3]]))
    u8 = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(dst[0]), u8(src[4])) and torch.equal(u8(dst[3]), u8(src[1]))
    for b in (1, 2, 4):
        assert torch.equal(u8(dst[b]), u8(before[b]))


# ---- the conformance kit's fp8 cases ---------------------------------------------------


def _kit_cases(target, fn, dtype, prefix):
    from pagedserve.testing.op_checks import OP_CASES

    return [(d, b) for d, b in OP_CASES["paged_attention"](target, fn, dtype, 0) if d.startswith(prefix)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conformance_kit_fp8_cases_pass_on_the_cpu_platform(dtype):
    """Both layouts of both fp8 names: rows with scales (-rows-) and unscaled rows."""
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    cases = _kit_cases(target, target.ops.get("paged_attention"), dtype, "kv-fp8")
    assert len(cases) == 8 and sum("-rows-" in d for d, _ in cases) == 4
    for _desc, body in cases:
        body()


def test_conformance_kit_fp8_row_cases_catch_an_attention_that_ignores_the_scales():
    from pagedserve.testing.target import select_target

    target = select_target("cpu")

    def unscaled(query, key_cache, value_cache, *rest, **kw):  # reads the values, not values * scale
        d = query.shape[-1]
        k, v = key_cache[..., :d].float(), value_cache[..., :d].float()
        return reference.paged_attention(query, k, v, *rest, **kw)

    cases = _kit_cases(target, unscaled, torch.float32, "kv-fp8_e4m3-rows")
    assert cases
    for _desc, body in cases:
        with pytest.raises(AssertionError, match="paged_attention over a KV cache of fp8_e4m3 with row scales"):
            body()
