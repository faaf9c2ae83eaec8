"""8-bit float KV caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2) at the op level.

The cache write (reference and native) stores kernels/reference.py's ``quantize_kv`` of
the keys and values, byte for byte; every CPU attention implementation (the native
kernel with each runnable instruction set, the AMX candidates, sdpa, the tuned op) on
an fp8 cache matches the reference on the dequantized cache; block copies move the
bytes.  Fresh random inputs, outputs poisoned with NaN, blocks no sequence owns filled
with NaN, block tables with random ids in their unused columns.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from native_build import native_build_failed

from pagedserve.executor.model_runner import check_cache_dtype, kv_cache_torch_dtype
from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu import NativeCpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu.native import dequantized_blocks
from pagedserve.kv_cache.kv_dtype import QUANTIZED_KV_DTYPES
from pagedserve.platforms.cpu.attention_ops import attention_candidates
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.cpu.tuned_attention import TunedAttention
from pagedserve.platforms.cpu.tuning import Tuner
from tests.kernels.test_cpu_kernels import assert_close, make_batch, runnable_isas

pytestmark = pytest.mark.timeout(600)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
# (q_len, seq_len): decodes, a whole prompt, prefix-cache continuations, block edges.
SEQS = [(1, 37), (23, 23), (20, 150), (1, 300), (16, 64), (1, 1), (5, 48)]


@pytest.fixture(scope="module")
def every_isa() -> dict[str, NativeCpuKernels]:
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(mod)}


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def fp8_batch(seqs, heads, head_size, block_size, dtype, kv_dtype, gen, head_major=True, key_scale=4.0):
    """make_batch's inputs with the caches quantized to ``kv_dtype`` (keys spread wider
    than values, as a model's are) and every block no sequence reads set to NaN."""
    q, kc, vc, tables, seq_lens, qsl = make_batch(seqs, *heads, head_size, block_size, torch.float32, gen,
                                                   head_major=head_major)  # fmt: skip
    kc = reference.quantize_kv(kc * key_scale, kv_dtype)
    vc = reference.quantize_kv(vc, kv_dtype)
    owned = set()
    for i, ctx in enumerate(seq_lens.tolist()):
        owned.update(tables[i, : (ctx + block_size - 1) // block_size].tolist())
    for b in range(kc.shape[0]):
        if b not in owned:
            kc[b] = float("nan")
            vc[b] = float("nan")
    return q.to(dtype), kc, vc, tables, seq_lens, qsl


def expected_attention(args, **extra) -> torch.Tensor:
    """The reference on float32 copies of everything (fp8 -> float32 is exact)."""
    q, kc, vc, *meta = args
    return reference.paged_attention(q.float(), kc.float(), vc.float(), *meta, q.shape[-1] ** -0.5, **extra)


# ---- the cache write ------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_quantize_kv_saturates_rounds_and_keeps_nan(kv_dtype):
    big = torch.finfo(kv_dtype).max
    x = torch.randn(4096, generator=gen_for(kv_dtype)) * 20
    x[:4] = torch.tensor([1e9, -1e9, big * 1.5, float("nan")])
    got = reference.quantize_kv(x, kv_dtype)
    assert got.dtype == kv_dtype
    g = got.float()
    assert g[0] == big and g[1] == -big and g[2] == big and g[3].isnan()
    assert not g.isinf().any()
    # Round to nearest: no representable value lies strictly closer than the stored one.
    table = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    table = table[table.isfinite()]
    finite = x[4:]
    nearest = (finite.view(-1, 1) - table.view(1, -1)).abs().min(dim=1).values
    assert torch.equal((finite - g[4:]).abs(), nearest)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reshape_and_cache_writes_the_quantized_bytes(every_isa, kv_dtype, head_major, dtype):
    gen = gen_for("write", kv_dtype, head_major, dtype)
    blocks, bs, kvh, d = 9, 16, 2, 64
    shape = (blocks, kvh, bs, d) if head_major else (blocks, bs, kvh, d)
    # Caches full of random bytes: a slot not written must keep its byte.
    init = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(kv_dtype)
    if head_major:
        init = init.transpose(1, 2)
    n = 40
    key = (torch.randn(n, kvh, d, generator=gen) * 50).to(dtype)
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    key[0, 0, :3] = torch.tensor([1e6, -1e6, 500.0]).to(dtype)  # beyond e4m3's 448 (and e5m2's range)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[5] = -1  # padding: not written
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    u8 = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    # The reference: quantize_kv's bytes at the slots, everything else untouched.
    manual = u8(init).clone().view(kv_dtype)
    for t in range(n):
        if slots[t] >= 0:
            manual[slots[t] // bs, slots[t] % bs] = reference.quantize_kv(key[t], kv_dtype)
    assert torch.equal(u8(want_k), u8(manual))
    assert not want_k.float().isinf().any() or init.float().isinf().any()
    for isa, kernels in every_isa.items():
        kc, vc = init.clone(), init.clone()
        if head_major:  # clone keeps the strides; make sure the layout is the one asked for
            assert kc.stride(1) < kc.stride(2)
        kernels.reshape_and_cache(key, value, kc, vc, slots)
        assert torch.equal(u8(kc), u8(want_k)), isa
        assert torch.equal(u8(vc), u8(want_v)), isa


# ---- attention ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_native_attention_reads_fp8_caches(every_isa, kv_dtype, dtype, head_size, heads):
    gen = gen_for("attn", kv_dtype, dtype, head_size, heads)
    args = fp8_batch(SEQS, heads, head_size, 16, dtype, kv_dtype, gen)
    expected = expected_attention(args)
    scale = head_size**-0.5
    # The reference itself reads the fp8 cache as its exact float32 values.
    ref = reference.paged_attention(*args, scale, torch.full_like(args[0], float("nan")))
    assert_close(ref, expected, dtype, "reference on the fp8 cache")
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out) is out
        assert_close(out, expected, dtype, f"{isa} {kv_dtype}")


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 7}, {"sliding_window": 33, "soft_cap": 4.0}, {"soft_cap": 2.5}],
    ids=["w7", "w33-cap", "cap"],
)
def test_native_attention_fp8_window_soft_cap_and_slid_out_blocks(every_isa, kv_dtype, extra):
    """Slid-out table entries point at a NaN block, which must never be read."""
    gen = gen_for("window", kv_dtype, repr(extra))
    q, kc, vc, tables, seq_lens, qsl = fp8_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, kv_dtype, gen)
    nan_block = int(kc.float().flatten(1).isnan().all(1).nonzero()[0])  # one no sequence owns
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


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_every_cpu_attention_candidate_reads_fp8_caches(every_isa, kv_dtype):
    kernels = next(iter(every_isa.values()))
    candidates = attention_candidates(kernels)
    gen = gen_for("candidates", kv_dtype)
    args = fp8_batch(SEQS, (9, 3), 64, 16, torch.bfloat16, kv_dtype, gen)
    expected = expected_attention(args)
    # The tuned op must route an fp8 cache away from the timed (bf16) candidates: a plan
    # naming sdpa for every bucket would otherwise be taken.
    tuned = TunedAttention(Tuner(None), {"sdpa": candidates["sdpa"]}, static=kernels.paged_attention)
    fns = dict(candidates, tuned=tuned.op())
    for name, fn in fns.items():
        out = torch.full_like(args[0], float("nan"))
        fn(*args, 64**-0.5, out)
        assert_close(out, expected, torch.bfloat16, f"{name} {kv_dtype}")
    assert tuned.plans == {}, "an fp8 cache was timed on the bf16 candidates"


def test_dequantized_blocks_renumbers_only_the_blocks_read():
    gen = gen_for("dequant")
    q, kc, vc, tables, seq_lens, qsl = fp8_batch(SEQS, (4, 2), 64, 16, torch.bfloat16, torch.float8_e5m2, gen)
    k2, v2, t2 = dequantized_blocks(kc, vc, tables, seq_lens, torch.bfloat16)
    read = {b for i, ctx in enumerate(seq_lens.tolist()) for b in tables[i, : (ctx + 15) // 16].tolist()}
    assert k2.shape[0] == len(read) and k2.dtype == torch.bfloat16
    assert k2.stride(1) < k2.stride(2), "the head-major layout is kept"
    assert not k2.isnan().any() and not v2.isnan().any()
    for i, ctx in enumerate(seq_lens.tolist()):
        for j in range((ctx + 15) // 16):
            assert torch.equal(k2[t2[i, j]].float(), kc[tables[i, j]].float())
            assert torch.equal(v2[t2[i, j]].float(), vc[tables[i, j]].float())


# ---- block copies (prefix-cache copies, the host tier's swaps) -------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_copy_and_swap_blocks_move_fp8_bytes(kv_dtype):
    gen = gen_for("copy", kv_dtype)
    src = torch.randint(0, 256, (6, 2, 16, 64), generator=gen, dtype=torch.uint8).view(kv_dtype).transpose(1, 2)
    dst = torch.randint(0, 256, (5, 2, 16, 64), generator=gen, dtype=torch.uint8).view(kv_dtype).transpose(1, 2)
    before = dst.clone()
    mapping = torch.tensor([[4, 0], [1, 3]])
    reference.swap_blocks(src, dst, mapping)
    u8 = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(dst[0]), u8(src[4])) and torch.equal(u8(dst[3]), u8(src[1]))
    for b in (1, 2, 4):
        assert torch.equal(u8(dst[b]), u8(before[b]))


# ---- the platform capability ----------------------------------------------------------


def test_cpu_platform_declares_both_fp8_formats():
    assert set(CpuPlatform.kv_cache_dtypes) == set(QUANTIZED_KV_DTYPES)
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    assert kv_cache_torch_dtype("auto", torch.float32) is torch.float32


def test_a_platform_without_the_capability_is_refused_by_name():
    from pagedserve.platforms.interface import Platform

    class Bare(Platform):
        name = "bare"

    class Int8Only(Platform):
        name = "int8-only"
        kv_cache_dtypes = ("int8",)

    for cls in (Bare, Int8Only):
        msg = rf"kv_cache_dtype='fp8' is not supported on platform '{cls.name}'.*fp8_e4m3"
        with pytest.raises(ValueError, match=msg):
            check_cache_dtype("fp8", torch.bfloat16, [cls])
    check_cache_dtype("fp8_e5m2", torch.bfloat16, [CpuPlatform])
    with pytest.raises(ValueError, match="differs from the model's dtype"):
        check_cache_dtype("float16", torch.bfloat16, [CpuPlatform])


# ---- the native kernel's in-register conversion ---------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_native_kv8_conversion_is_exact_for_every_byte(every_isa, kv_dtype):
    """One key per sequence: the output is its value row times probability 1, so each of
    the 256 byte patterns (NaN included) must come out as its exact float32 value."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype).view(1, 1, 4, 64)
    key = torch.zeros(1, 1, 4, 64, dtype=torch.uint8).view(kv_dtype)
    query = torch.randn(1, 4, 64, generator=gen_for("bytes", kv_dtype))
    args = (query, key, values, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
    want = values.float().view(1, 4, 64)
    for isa, kernels in every_isa.items():
        out = torch.full_like(query, 7.0)
        kernels.paged_attention(*args, 0.125, out)
        assert torch.equal(out.isnan(), want.isnan()), isa
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), isa


def test_avx512_kernels_read_fp8_rows_without_dequantizing(every_isa, monkeypatch, caplog):
    import pagedserve.kernels.cpu.native as native_mod

    with_kv8 = {isa: k for isa, k in every_isa.items() if k.has_kv8_attention}
    assert set(with_kv8) == {i for i in every_isa if i.startswith("avx512")}
    gen = gen_for("no-dequant")
    args = fp8_batch(SEQS, (8, 2), 64, 16, torch.bfloat16, torch.float8_e4m3fn, gen)
    expected = expected_attention(args)

    def forbidden(*_a, **_k):
        raise AssertionError("the blocks were dequantized")

    monkeypatch.setattr(native_mod, "dequantized_blocks", forbidden)
    for isa, kernels in with_kv8.items():
        out = torch.full_like(args[0], float("nan"))
        kernels.paged_attention(*args, 64**-0.5, out)
        assert_close(out, expected, torch.bfloat16, isa)
    monkeypatch.undo()
    # A float16 query has no kv8 kernel: dequantized, and said once.
    monkeypatch.setattr(native_mod, "_logged_quantized_cache", False)
    kernels = next(iter(every_isa.values()))
    q16 = args[0].to(torch.float16)
    with caplog.at_level("WARNING", logger=native_mod.__name__):
        for _ in range(2):
            out = torch.full_like(q16, float("nan"))
            kernels.paged_attention(q16, *args[1:], 64**-0.5, out)
            assert_close(out, expected, torch.float16, "float16 query")
    assert sum("dequantizes the blocks" in r.message for r in caplog.records) == 1
