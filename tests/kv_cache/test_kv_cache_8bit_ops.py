"""Every 8-bit KV cache kind (int8 rows, fp8 rows with their scales, unscaled fp8) at the
op level.

The cache write (reference and native) stores the reference's bytes (kernels/reference.py
``quantize_kv_rows`` / ``quantize_kv``) and leaves every other slot's bytes alone; every
CPU attention implementation (the native kernel with each runnable instruction set, the
AMX candidates, sdpa, the tuned op) matches the reference on the dequantized float32
cache for bf16, float32 and float16 queries; AVX-512 reads the rows in registers
(float16 queries: the blocks dequantized, said once); ``dequantized_blocks`` renumbers
only the blocks read; block copies move the bytes, scales included.  Fresh random
inputs, outputs poisoned with NaN, blocks no sequence owns given NaN scales (or NaN
values), block tables with random ids in their unused columns.

Each format's own rules are in test_kv_cache_int8_ops.py, test_kv_cache_fp8_rows_ops.py
and test_kv_cache_dtype_ops.py; bf16 queries in depth (every byte, head sizes, windows,
split contexts) in test_kv_cache_kv8_bf16.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.native import dequantized_blocks
from pagedserve.platforms.cpu.attention_ops import attention_candidates
from pagedserve.platforms.cpu.tuned_attention import TunedAttention
from pagedserve.platforms.cpu.tuning import Tuner
from tests.kernels.test_cpu_kernels import assert_close
from tests.kv_cache.kv8_inputs import (
    KIND_IDS,
    KINDS,
    SEQS,
    dequantized,
    expected_attention,
    gen_for,
    kv8_batch,
    quantized_rows,
)

pytestmark = pytest.mark.timeout(600)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- the cache write ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reshape_and_cache_writes_the_reference_bytes(every_isa, kind, head_major, dtype):
    name, kv, scaled = kind
    gen = gen_for("write", name, head_major, dtype)
    blocks, bs, kvh, d = 9, 16, 2, 64
    row = d + 4 if scaled else d
    shape = (blocks, kvh, bs, row) if head_major else (blocks, bs, kvh, row)
    # Caches full of random bytes: a slot not written must keep its bytes.
    init = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(kv)
    if head_major:
        init = init.transpose(1, 2)
    n = 40
    key = (torch.randn(n, kvh, d, generator=gen) * 50).to(dtype)
    key[::4, 0, 7] = 3e4  # outliers: a row's scale, or e4m3's saturation
    key[0, 0, :3] = torch.tensor([1e6, -1e6, 500.0]).to(dtype)  # beyond every fp8 range
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[5] = -1  # padding: not written
    want_k, want_v = init.clone(), init.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    manual = u8(init).clone()
    for t in range(n):
        if slots[t] >= 0:
            manual[slots[t] // bs, slots[t] % bs] = u8(quantized_rows(key[t], kind))
    assert torch.equal(u8(want_k), manual)
    for isa, kernels in every_isa.items():
        kc, vc = init.clone(), init.clone()
        if head_major:  # clone keeps the strides; make sure the layout is the one asked for
            assert kc.stride(1) < kc.stride(2)
        kernels.reshape_and_cache(key, value, kc, vc, slots)
        assert torch.equal(u8(kc), u8(want_k)), isa
        assert torch.equal(u8(vc), u8(want_v)), isa


# ---- attention ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize(
    "head_size,heads",
    [(64, (4, 4)), (64, (8, 2)), (128, (4, 4)), (128, (8, 2))],
    ids=["d64-mha", "d64-gqa4", "d128-mha", "d128-gqa4"],
)
def test_native_attention_matches_the_reference(every_isa, kind, dtype, head_size, heads):
    gen = gen_for("attn", kind[0], dtype, head_size, heads)
    args = kv8_batch(SEQS, heads, head_size, kind, gen, dtype=dtype)
    expected = expected_attention(args)
    scale = head_size**-0.5
    ref = reference.paged_attention(*args, scale, torch.full_like(args[0], float("nan")))
    assert_close(ref, expected, dtype, f"reference on the {kind[0]} cache")
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, scale, out) is out
        assert_close(out, expected, dtype, f"{isa} {kind[0]}")


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_every_cpu_attention_candidate_reads_8bit_caches(every_isa, kind):
    kernels = next(iter(every_isa.values()))
    candidates = attention_candidates(kernels)
    args = kv8_batch(SEQS, (9, 3), 64, kind, gen_for("candidates", kind[0]))
    expected = expected_attention(args)
    # The tuned op must route an 8-bit cache away from the timed (bf16) candidates: a plan
    # naming sdpa for every bucket would otherwise be taken.
    tuned = TunedAttention(Tuner(None), {"sdpa": candidates["sdpa"]}, static=kernels.paged_attention)
    fns = dict(candidates, tuned=tuned.op())
    for name, fn in fns.items():
        out = torch.full_like(args[0], float("nan"))
        fn(*args, 64**-0.5, out)
        assert_close(out, expected, torch.bfloat16, f"{name} {kind[0]}")
    assert tuned.plans == {}, f"a {kind[0]} cache was timed on the bf16 candidates"


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_avx512_kernels_read_8bit_rows_without_dequantizing(every_isa, monkeypatch, caplog, kind):
    """AVX-512 reads the rows (and their scales) in registers for float32 and bf16
    queries; the other instruction sets and float16 queries run on the dequantized
    blocks, which is logged once."""
    import pagedserve.kernels.cpu.native as native_mod

    with_kv8 = {isa: k for isa, k in every_isa.items() if k.has_kv8_attention}
    assert set(with_kv8) == {i for i in every_isa if i.startswith("avx512")}
    # Keys spread less than elsewhere: this checks the path, at float32's tolerance.
    args = kv8_batch(SEQS, (8, 2), 64, kind, gen_for("no-dequant", kind[0]), key_scale=2.0)
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
    monkeypatch.setattr(native_mod, "_logged_quantized_cache", False)
    q16 = args[0].to(torch.float16)
    with caplog.at_level("WARNING", logger=native_mod.__name__):
        for _ in range(2):
            out = torch.full_like(q16, float("nan"))
            next(iter(every_isa.values())).paged_attention(q16, *args[1:], 64**-0.5, out)
            assert_close(out, expected, torch.float16, "float16 query")
    assert called, "a float16 query has no in-register 8-bit kernel: its blocks are dequantized"
    assert sum("dequantizes the blocks" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantized_blocks_renumbers_only_the_blocks_read(kind, dtype):
    q, kc, vc, tables, seq_lens, qsl = kv8_batch(SEQS, (4, 2), 64, kind, gen_for("dequant", kind[0]))
    k2, v2, t2 = dequantized_blocks(kc, vc, tables, seq_lens, dtype, 64)
    read = {b for i, ctx in enumerate(seq_lens.tolist()) for b in tables[i, : (ctx + 15) // 16].tolist()}
    assert k2.shape == (len(read), 16, 2, 64) and k2.dtype == dtype
    assert k2.stride(1) < k2.stride(2), "the head-major layout is kept"
    assert not k2.isnan().any() and not v2.isnan().any()
    for i, ctx in enumerate(seq_lens.tolist()):
        for j in range((ctx + 15) // 16):
            assert torch.equal(k2[t2[i, j]], dequantized(kc[tables[i, j]], 64).to(dtype))
            assert torch.equal(v2[t2[i, j]], dequantized(vc[tables[i, j]], 64).to(dtype))


# ---- block copies (prefix-cache copies, the host tier's swaps) -------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_copy_and_swap_blocks_move_the_bytes(kind):
    name, kv, scaled = kind
    gen = gen_for("copy", name)
    row = 68 if scaled else 64
    src = torch.randint(0, 256, (6, 2, 16, row), generator=gen, dtype=torch.uint8).view(kv).transpose(1, 2)
    dst = torch.randint(0, 256, (5, 2, 16, row), generator=gen, dtype=torch.uint8).view(kv).transpose(1, 2)
    before = dst.clone()
    reference.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 3]]))
    assert torch.equal(u8(dst[0]), u8(src[4])) and torch.equal(u8(dst[3]), u8(src[1]))
    for b in (1, 2, 4):
        assert torch.equal(u8(dst[b]), u8(before[b]))
