"""The Triton cache write and attention on fp8 KV caches against kernels/reference.py.

Both formats (float8_e4m3fn, float8_e5m2) in both layouts: rows of head_size + 4 (the
values x / s, then the row's float32 scale s = absmax / 448 or / 57344) and unscaled rows
of head_size (a saturating cast).  The kernels read and write fp8 through a uint8 view
with integer conversions (kernels/triton/fp8.py): every byte must decode to torch's
value and every float32 must encode to torch's byte; the write must store the
reference's bytes; attention must match the reference reading the same cache; the
conformance kit's 8-bit cases must pass on the cuda and rocm platforms' ops.  Runs under
Triton's interpreter without a GPU (TRITON_INTERPRET=1, set before triton is imported),
tiny shapes, and on the GPU when there is one.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import triton.language as tl  # noqa: E402

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention, cache  # noqa: E402
from pagedserve.kernels.triton.fp8 import float32_to_fp8, fp8_to_float32  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
NAN_SCALE = torch.tensor([float("nan")]).view(torch.uint8)


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- the conversions ------------------------------------------------------------------


@triton.jit
def _decode_kernel(src_ptr, dst_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(dst_ptr + offs, fp8_to_float32(b, E5M2), mask=offs < n)


@triton.jit
def _encode_kernel(src_ptr, dst_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
    tl.store(dst_ptr + offs, float32_to_fp8(y, E5M2).to(tl.uint8), mask=offs < n)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_every_byte_decodes_to_its_exact_value(kv_dtype):
    src = torch.arange(256, dtype=torch.uint8)
    out = torch.full((256,), 12345.0, device=DEVICE)  # poisoned
    _decode_kernel[(1,)](src.to(DEVICE), out, 256, E5M2=kv_dtype == torch.float8_e5m2, BLOCK=256)
    want = src.view(kv_dtype).float()
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))  # -0.0 too


def _encode_inputs(kv_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every finite fp8 value, the midpoints between neighbours (rounding ties) and one
    float32 ulp either side of them, subnormals, values past the largest finite one, the
    infinities, NaN and random magnitudes across the whole range, both signs."""
    finite = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    finite = finite[finite.isfinite()].unique()
    pos = finite[finite >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32
    near = torch.cat([mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(float("inf")))])
    top = torch.finfo(kv_dtype).max
    tiny = torch.finfo(kv_dtype).smallest_normal
    random = torch.exp(torch.empty(4000).uniform_(-25, 12.5, generator=gen))
    special = torch.tensor([top * 1.03, top * 1.2, top * 4, 1e30, float("inf"), float("nan"), tiny / 3, 1e-30, 0.0])
    x = torch.cat([pos, mids, near, random, special, torch.rand(500, generator=gen) * tiny])
    return torch.cat([x, -x])


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_encoding_is_torchs_saturating_round_to_nearest_even(kv_dtype):
    x = _encode_inputs(kv_dtype, gen_for("encode", str(kv_dtype)))
    out = torch.randint(0, 256, x.shape, dtype=torch.uint8, generator=gen_for("poison")).to(DEVICE)
    n = x.numel()
    _encode_kernel[(triton.cdiv(n, 1024),)](x.to(DEVICE), out, n, E5M2=kv_dtype == torch.float8_e5m2, BLOCK=1024)
    want = u8(reference.quantize_kv(x, kv_dtype))
    got = out.cpu()
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:10]]


# ---- the cache write ------------------------------------------------------------------


def _random_cache(storage, head_major, kv_dtype, gen):
    init = torch.randint(0, 256, storage, generator=gen, dtype=torch.uint8).view(kv_dtype)
    return init.transpose(1, 2) if head_major else init


@pytest.mark.parametrize("rows_scaled", [True, False], ids=["rows", "unscaled"])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_triton_write_stores_the_reference_bytes(kv_dtype, dtype, head_major, rows_scaled):
    gen = gen_for("write", str(kv_dtype), dtype, head_major, rows_scaled)
    blocks, bs, kvh, d, n = 5, 8, 2, 32, 20
    row = d + 4 if rows_scaled else d
    storage = (blocks, kvh, bs, row) if head_major else (blocks, bs, kvh, row)
    init = _random_cache(storage, head_major, kv_dtype, gen)
    key = (torch.randn(n, kvh, d, generator=gen) * 100).to(dtype)  # beyond e4m3's range now and then
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    key[3, 1] = 0  # a zero row: scale 0
    key[4, 0, 2] = 3e5  # an outlier (past e5m2's range too: saturates when unscaled)
    value[5, 1, :3] = torch.tensor([1e-6, -3e-8, 2.0**-9])  # subnormal values
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[7] = -1
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    kc, vc = init.clone().to(DEVICE), init.clone().to(DEVICE)
    if head_major:
        kc, vc = kc.as_strided(init.shape, init.stride()), vc.as_strided(init.shape, init.stride())
    cache.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE))
    assert torch.equal(u8(kc.cpu()), u8(want_k))
    assert torch.equal(u8(vc.cpu()), u8(want_v))


def test_triton_write_refuses_fp8_rows_of_another_width():
    key = torch.randn(2, 1, 32)
    kc = torch.zeros(2, 4, 1, 34, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs fp8 rows of 32 \\(unscaled\\) or 36"):
        cache.reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([0, 1]))
    key = torch.randn(2, 1, 34)
    kc = torch.zeros(2, 4, 1, 34 + 4, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="head_size a multiple of 4"):
        cache.reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([0, 1]))


# ---- attention ------------------------------------------------------------------------


def _fp8_batch(seqs, heads, d, bs, kv_dtype, rows_scaled, dtype, gen, window=None):
    """An fp8 cache written by the reference (keys spread wider than values, rows with an
    outlier), a block no sequence reads made of NaN (NaN scales, or NaN bytes when
    unscaled) that slid-out table entries point at."""
    num_heads, kvh = heads
    need = [(ctx + bs - 1) // bs for _, ctx in seqs]
    nb = sum(need) + 2
    row = d + 4 if rows_scaled else d
    keys = torch.randn(nb * bs, kvh, d, generator=gen) * (3.0 if rows_scaled else 8.0)
    keys[::5, :, 0] *= 40  # outliers: past e4m3's range (a row scale absorbs them; unscaled saturates)
    values = torch.randn(nb * bs, kvh, d, generator=gen)
    kc = torch.zeros(nb, bs, kvh, row, dtype=kv_dtype)
    vc = torch.zeros(nb, bs, kvh, row, dtype=kv_dtype)
    reference.reshape_and_cache(keys, values, kc, vc, torch.arange(nb * bs))
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    null = int(ids[-1])
    tables = torch.full((len(seqs), max(need) + 1), null, dtype=torch.int32)
    for c in (kc, vc):
        if rows_scaled:
            c.view(torch.uint8)[null, ..., d:] = NAN_SCALE
        else:
            c.view(torch.uint8)[null] = 0x7F  # NaN in both formats
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start : start + n]
        start += n
    if window is not None:  # slid-out entries point at the NaN block
        for i, (q_len, ctx) in enumerate(seqs):
            tables[i, : max(0, ctx - q_len - window + 1) // bs] = null
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), num_heads, d, generator=gen).to(dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, kc, vc, tables, seq_lens, qsl


ATTN_CASES = [
    ([(1, 13), (6, 6), (3, 21)], (4, 2), {}, torch.float32, 1),
    ([(1, 13), (3, 21)], (4, 2), {}, torch.float16, 1),
    ([(1, 13), (5, 21)], (6, 3), {}, torch.bfloat16, 1),
    ([(1, 30), (4, 17)], (4, 1), {"sliding_window": 9}, torch.float32, 1),
    ([(2, 11)], (2, 2), {"soft_cap": 3.0}, torch.float32, 1),
    ([(1, 40), (1, 9)], (4, 2), {}, torch.float32, 3),
]


@pytest.mark.parametrize("rows_scaled", [True, False], ids=["rows", "unscaled"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(
    "seqs,heads,extra,dtype,splits", ATTN_CASES, ids=["mixed-fp32", "fp16", "gqa-bf16", "window", "cap", "split3"]
)
def test_triton_attention_reads_fp8_caches(seqs, heads, extra, dtype, splits, kv_dtype, rows_scaled):
    gen = gen_for("attn", repr(seqs), dtype, str(kv_dtype), rows_scaled, splits)
    d, bs = 32, 8
    query, kc, vc, tables, seq_lens, qsl = _fp8_batch(
        seqs, heads, d, bs, kv_dtype, rows_scaled, dtype, gen, extra.get("sliding_window")
    )
    scale = d**-0.5
    want = reference.paged_attention(query.float(), kc, vc, tables, seq_lens, qsl, scale, **extra)
    assert not want.isnan().any()
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (query, kc, vc, tables, seq_lens, qsl)]
    got = attention.paged_attention_fixed_splits(*dev, scale, splits, out, **extra)
    assert got is out
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


def test_triton_attention_refuses_fp8_rows_of_another_width():
    gen = gen_for("refuse")
    query, kc, vc, tables, seq_lens, qsl = _fp8_batch([(1, 5)], (2, 1), 32, 8, FP8[0], True, torch.float32, gen)
    args = (tables, seq_lens, qsl, 32**-0.5)
    with pytest.raises(ValueError, match="needs fp8 rows of 32 \\(unscaled\\) or 36"):
        attention.paged_attention(query, kc[..., :34], vc[..., :34], *args)
    with pytest.raises(ValueError, match="value_cache dtype"):
        attention.paged_attention(query, kc, vc.view(torch.uint8).view(torch.float8_e5m2), *args)


# ---- the conformance kit on the cuda and rocm platforms' ops --------------------------


def _gpu_target(name: str):
    """The named GPU platform with its registered ops, its tensors on the host (the
    Triton interpreter runs the kernels there) unless a GPU is present."""
    from pagedserve.platforms import PlatformInfo
    from pagedserve.platforms.cuda import CudaPlatform
    from pagedserve.platforms.cuda.ops import register_cuda_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.options import GpuOptions
    from pagedserve.platforms.rocm import RocmPlatform
    from pagedserve.platforms.rocm.ops import register_rocm_ops
    from pagedserve.testing.target import Target

    cls = {"cuda": CudaPlatform, "rocm": RocmPlatform}[name]

    class Here(cls):
        device_type = DEVICE

    ops = OpRegistry()
    if name == "cuda":
        register_cuda_ops(ops, GpuOptions(kernels="triton"))
    else:
        register_rocm_ops(ops)
    assert ops.source("paged_attention") == ops.source("reshape_and_cache") == "triton"
    info = PlatformInfo(name, Here, name, "builtin", _probe=(True, "Triton kernels on " + DEVICE))
    return Target(info, Here(GpuOptions(kernels="triton")), ops, None, False)


def _kit_cases(target, fn, dtype):
    from pagedserve.testing.op_checks import OP_CASES

    return [(d, b) for d, b in OP_CASES["paged_attention"](target, fn, dtype, 0) if d.startswith("kv-")]


@pytest.mark.parametrize(
    "platform,dtype",
    [
        ("cuda", torch.float32),
        # The same kernels again (about 15 s of interpreter each): slow.
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.slow),
        pytest.param("rocm", torch.float16, marks=pytest.mark.slow),
    ],
    ids=["cuda-fp32", "cuda-bf16", "rocm-fp16"],
)
def test_conformance_kit_8bit_cases_pass_on_the_gpu_platforms(platform, dtype):
    """Every declared 8-bit dtype, fp8 in both layouts: the platform's reshape_and_cache
    stores the reference's bytes and its paged_attention matches the reference."""
    target = _gpu_target(platform)
    assert set(target.platform.kv_cache_dtypes) == {"fp8_e4m3", "fp8_e5m2", "int8"}
    cases = _kit_cases(target, target.ops.get("paged_attention"), dtype)
    descs = [d for d, _ in cases]
    assert len(cases) == 10 and sum("-rows-" in d for d in descs) == 4, descs
    for _desc, body in cases:
        body()
