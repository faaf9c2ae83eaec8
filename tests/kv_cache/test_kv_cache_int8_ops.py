"""int8 KV caches with a scale per token and KV head (kv_cache_dtype int8) at the op level.

An int8 cache row is ``head_size`` int8 values followed by the 4 bytes of a float32
scale (``absmax / 127``, computed on write; kernels/reference.py).  The write (reference
and native) stores exactly those bytes; every CPU attention implementation (the native
kernel with each runnable instruction set, the AMX candidates, sdpa, the tuned op) on an
int8 cache matches the reference on the dequantized float32 cache; block copies move
values and scales together.  Fresh random inputs, outputs poisoned with NaN, blocks no
sequence owns given NaN scales, block tables with random ids in their unused columns.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from native_build import native_build_failed

from pagedserve.executor.model_runner import kv_cache_torch_dtype, kv_row_size
from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu import NativeCpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu.native import dequantized_blocks
from pagedserve.kv_cache import kv_dtype
from pagedserve.platforms.cpu.attention_ops import attention_candidates
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.cpu.tuned_attention import TunedAttention
from pagedserve.platforms.cpu.tuning import Tuner
from tests.kernels.test_cpu_kernels import assert_close, make_batch, runnable_isas

pytestmark = pytest.mark.timeout(600)

# (q_len, seq_len): decodes, a whole prompt, prefix-cache continuations, block edges.
SEQS = [(1, 37), (23, 23), (20, 150), (1, 300), (16, 64), (1, 1), (5, 48)]
NAN_SCALE = torch.tensor([float("nan")]).view(torch.int8)


@pytest.fixture(scope="module")
def every_isa() -> dict[str, NativeCpuKernels]:
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(mod)}


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def int8_cache(values: torch.Tensor, head_major: bool) -> torch.Tensor:
    """``values [blocks, block_size, kv_heads, d]`` quantized into an int8 cache
    ``[..., d + 4]`` (head-major storage like the CPU platform's, or token-major)."""
    nb, bs, kvh, d = values.shape
    if head_major:
        cache = torch.empty(nb, kvh, bs, d + 4, dtype=torch.int8).transpose(1, 2)
    else:
        cache = torch.empty(nb, bs, kvh, d + 4, dtype=torch.int8)
    cache.copy_(reference.quantize_kv_int8(values))
    return cache


def int8_batch(seqs, heads, head_size, block_size, dtype, gen, head_major=True, key_scale=4.0):
    """make_batch's inputs with int8 caches (keys spread wider than values, some rows with
    an outlier, as a model's are) and every block no sequence reads given NaN scales."""
    q, kc, vc, tables, seq_lens, qsl = make_batch(seqs, *heads, head_size, block_size, torch.float32, gen)
    kc = kc * key_scale
    kc[::3, :, :, 0] *= 8.0  # large-magnitude channels: a per-row scale keeps the rest fine
    kc, vc = int8_cache(kc, head_major), int8_cache(vc, head_major)
    owned = set()
    for i, ctx in enumerate(seq_lens.tolist()):
        owned.update(tables[i, : (ctx + block_size - 1) // block_size].tolist())
    for b in range(kc.shape[0]):
        if b not in owned:
            kc[b, ..., head_size:] = NAN_SCALE
            vc[b, ..., head_size:] = NAN_SCALE
    return q.to(dtype), kc, vc, tables, seq_lens, qsl


def dequantized(cache: torch.Tensor) -> torch.Tensor:
    return reference.dequantize_kv(cache, cache.shape[-1] - 4)


def expected_attention(args, **extra) -> torch.Tensor:
    """The reference on float32 copies of everything (the caches dequantized)."""
    q, kc, vc, *meta = args
    return reference.paged_attention(q.float(), dequantized(kc), dequantized(vc), *meta, q.shape[-1] ** -0.5, **extra)


# ---- the format -----------------------------------------------------------------------


def test_quantize_kv_int8_rows_hold_values_then_their_scale():
    gen = gen_for("format")
    x = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 50
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 5] = 1e4  # one outlier sets its row's scale only
    rows = reference.quantize_kv_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (300, 3, 68)
    q, s = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 127)
    assert q.abs().max() == 127 and q.min() >= -127
    # Round half to even of the float32 quotient x / s (the specified rounding).
    want = torch.where(s > 0, x / s, torch.zeros_like(x)).round()
    assert torch.equal(q.float(), want)
    back = reference.dequantize_kv(rows, 64)
    assert torch.equal(back, q.float() * s)
    assert ((back - x).abs() <= s / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert (back[1, 0] - x[1, 0]).abs().max() < 0.2  # the outlier did not coarsen other rows
    with pytest.raises(ValueError, match="head_size \\+ 4 = 68"):
        reference.dequantize_kv(rows[..., :66], 64)


def test_row_sizes_agree_between_core_and_the_reference():
    assert kv_dtype.KV_SCALE_BYTES == reference.INT8_KV_SCALE_BYTES == 4
    for d in (64, 128):
        assert kv_row_size(d, torch.int8) == reference.kv_row_size(d, torch.int8) == d + 4
        assert kv_row_size(d, torch.bfloat16) == reference.kv_row_size(d, torch.bfloat16) == d
        # fp8 rows carry a scale too unless per-layer scales are used (test_kv_cache_fp8_rows_ops.py).
        assert kv_row_size(d, torch.float8_e4m3fn, False) == reference.kv_row_size(d, torch.float8_e4m3fn, False) == d
    assert kv_cache_torch_dtype("int8", torch.bfloat16) is torch.int8
    assert "int8" in CpuPlatform.kv_cache_dtypes


def test_gpu_platforms_declare_every_8bit_dtype():
    """Their Triton kernels (and the CUDA C++ ops, which hand 8-bit caches to Triton) read
    int8 and fp8 caches (tests/kernels/test_triton_int8_kv.py, test_triton_fp8_kv.py)."""
    from pagedserve.executor.model_runner import check_cache_dtype
    from pagedserve.platforms.cuda import CudaPlatform
    from pagedserve.platforms.rocm import RocmPlatform

    for cls in (CudaPlatform, RocmPlatform):
        assert set(cls.kv_cache_dtypes) == {"int8", "fp8_e4m3", "fp8_e5m2"}
        for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
            check_cache_dtype(name, torch.bfloat16, [cls])


# ---- the cache write ------------------------------------------------------------------


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reshape_and_cache_writes_values_and_scales(every_isa, head_major, dtype):
    gen = gen_for("write", head_major, dtype)
    blocks, bs, kvh, d = 9, 16, 2, 64
    shape = (blocks, kvh, bs, d + 4) if head_major else (blocks, bs, kvh, d + 4)
    # Caches full of random bytes: a slot not written must keep its bytes.
    init = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    if head_major:
        init = init.transpose(1, 2)
    n = 40
    key = (torch.randn(n, kvh, d, generator=gen) * 50).to(dtype)
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[5] = -1  # padding: not written
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    manual = init.clone()
    for t in range(n):
        if slots[t] >= 0:
            manual[slots[t] // bs, slots[t] % bs] = reference.quantize_kv_int8(key[t])
    assert torch.equal(want_k, manual)
    for isa, kernels in every_isa.items():
        kc, vc = init.clone(), init.clone()
        if head_major:
            assert kc.stride(1) < kc.stride(2)
        kernels.reshape_and_cache(key, value, kc, vc, slots)
        assert torch.equal(kc, want_k), isa
        assert torch.equal(vc, want_v), isa


# ---- attention ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_native_attention_reads_int8_caches(every_isa, dtype, head_size, heads):
    gen = gen_for("attn", dtype, head_size, heads)
    args = int8_batch(SEQS, heads, head_size, 16, dtype, gen)
    expected = expected_attention(args)
    scale = head_size**-0.5
    ref = reference.paged_attention(*args, scale, torch.full_like(args[0], float("nan")))
    assert_close(ref, expected, dtype, "reference on the int8 cache")
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out) is out
        assert_close(out, expected, dtype, f"{isa} int8")


@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 7}, {"sliding_window": 33, "soft_cap": 4.0}, {"soft_cap": 2.5}],
    ids=["w7", "w33-cap", "cap"],
)
def test_native_attention_int8_window_soft_cap_and_slid_out_blocks(every_isa, extra):
    """Slid-out table entries point at a block with NaN scales, which must never be read."""
    gen = gen_for("window", repr(extra))
    q, kc, vc, tables, seq_lens, qsl = int8_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, gen)
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


def test_every_cpu_attention_candidate_reads_int8_caches(every_isa):
    kernels = next(iter(every_isa.values()))
    candidates = attention_candidates(kernels)
    gen = gen_for("candidates")
    args = int8_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, gen)
    expected = expected_attention(args)
    # The tuned op must route an int8 cache away from the timed (bf16) candidates.
    tuned = TunedAttention(Tuner(None), {"sdpa": candidates["sdpa"]}, static=kernels.paged_attention)
    fns = dict(candidates, tuned=tuned.op())
    for name, fn in fns.items():
        out = torch.full_like(args[0], float("nan"))
        fn(*args, 64**-0.5, out)
        assert_close(out, expected, torch.bfloat16, f"{name} int8")
    assert tuned.plans == {}, "an int8 cache was timed on the bf16 candidates"


def test_avx512_kernels_read_int8_rows_without_dequantizing(every_isa, monkeypatch):
    """AVX-512 reads int8 rows and their scales in registers (float32 and bf16 queries);
    the other instruction sets and float16 queries run on the dequantized blocks."""
    import pagedserve.kernels.cpu.native as native_mod

    with_kv8 = {isa: k for isa, k in every_isa.items() if k.has_kv8_attention}
    assert set(with_kv8) == {i for i in every_isa if i.startswith("avx512")}
    gen = gen_for("no-dequant")
    args = int8_batch(SEQS, (8, 2), 64, 16, torch.bfloat16, gen)
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
    assert called, "a float16 query has no in-register int8 kernel: its blocks are dequantized"


def test_dequantized_blocks_applies_the_scales():
    gen = gen_for("dequant")
    q, kc, vc, tables, seq_lens, qsl = int8_batch(SEQS, (4, 2), 64, 16, torch.float32, gen)
    k2, v2, t2 = dequantized_blocks(kc, vc, tables, seq_lens, torch.float32)
    read = {b for i, ctx in enumerate(seq_lens.tolist()) for b in tables[i, : (ctx + 15) // 16].tolist()}
    assert k2.shape == (len(read), 16, 2, 64) and k2.dtype == torch.float32
    assert k2.stride(1) < k2.stride(2), "the head-major layout is kept"
    assert not k2.isnan().any() and not v2.isnan().any()
    for i, ctx in enumerate(seq_lens.tolist()):
        for j in range((ctx + 15) // 16):
            assert torch.equal(k2[t2[i, j]], dequantized(kc[tables[i, j]]))
            assert torch.equal(v2[t2[i, j]], dequantized(vc[tables[i, j]]))


# ---- block copies (prefix-cache copies, the host tier's swaps) -------------------------


def test_copy_and_swap_blocks_move_values_and_scales():
    gen = gen_for("copy")
    src = torch.randint(-128, 128, (6, 2, 16, 68), generator=gen, dtype=torch.int8).transpose(1, 2)
    dst = torch.randint(-128, 128, (5, 2, 16, 68), generator=gen, dtype=torch.int8).transpose(1, 2)
    before = dst.clone()
    mapping = torch.tensor([[4, 0], [1, 3]])
    reference.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[3], src[1])
    for b in (1, 2, 4):
        assert torch.equal(dst[b], before[b])


# ---- the conformance kit's int8 cases --------------------------------------------------


def _kit_int8_cases(target, fn, dtype):
    from pagedserve.testing.op_checks import OP_CASES

    return [(d, b) for d, b in OP_CASES["paged_attention"](target, fn, dtype, 0) if d.startswith("kv-int8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conformance_kit_int8_cases_pass_on_the_cpu_platform(dtype):
    from pagedserve.testing.target import select_target

    target = select_target("cpu")
    cases = _kit_int8_cases(target, target.ops.get("paged_attention"), dtype)
    assert len(cases) == 2
    for _desc, body in cases:
        body()


def test_conformance_kit_int8_cases_catch_an_attention_that_ignores_the_scales():
    from pagedserve.testing.target import select_target

    target = select_target("cpu")

    def unscaled(query, key_cache, value_cache, *rest, **kw):  # reads the values, not values * scale
        d = query.shape[-1]
        k, v = key_cache[..., :d].float(), value_cache[..., :d].float()
        return reference.paged_attention(query, k, v, *rest, **kw)

    for _desc, body in _kit_int8_cases(target, unscaled, torch.float32):
        with pytest.raises(AssertionError, match="paged_attention over a KV cache of int8"):
            body()
