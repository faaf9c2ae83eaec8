"""Native CPU kernels (kernels/cpu) against the torch reference (kernels/reference.py).

Every comparison uses fresh random inputs (torch.randn, never zeros) and outputs
poisoned with NaN, with tolerances keyed by dtype.  Each instruction set compiled in
and runnable here is tested (AVX-512 with and without BF16 dot products, AVX2, the
portable path), forced through ``load_cpu_kernels(isa=...)``: attention inputs go
through all of them in one test (one reference computation), the row-wise ops are
parametrized by instruction set.

The kernels are built once into the persistent cache (PAGEDSERVE_KERNEL_CACHE or
~/.cache/pagedserve/kernels) and reused by later runs.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib

import pytest
import torch
from native_build import native_build_failed

from pagedserve.kernels import build, reference
from pagedserve.kernels.cpu import ISA_ORDER, NATIVE_OPS, NativeCpuKernels, choose_isa, load_cpu_kernels
from pagedserve.kernels.cpu.native import ISA_FEATURES

pytestmark = pytest.mark.timeout(600)

#: (atol, rtol) per dtype: fp32 differs from the reference only by summation order;
#: bf16/fp16 outputs may round one unit in the last place the other way.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def module():
    """The compiled extension (built on first use); the tests skip only without a compiler."""
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return mod


def runnable_isas(module) -> list[str]:
    features = build.read_cpu_features()
    return [i for i in module.compiled_isas() if not features or ISA_FEATURES[i] <= features]


@pytest.fixture(scope="module", params=ISA_ORDER)
def kernels(request, module) -> NativeCpuKernels:
    """The kernels bound to each instruction set this build and CPU can run."""
    if request.param not in runnable_isas(module):
        pytest.skip(f"{request.param} is not compiled in or not supported by this CPU")
    return load_cpu_kernels(isa=request.param)


@pytest.fixture(scope="module")
def packed_kernels(module) -> NativeCpuKernels:
    """The instruction set with the packed bf16 linear kernel (AVX-512 BF16)."""
    for isa in runnable_isas(module):
        kernels = load_cpu_kernels(isa=isa)
        if kernels.has_packed_linear:
            return kernels
    pytest.skip("no runnable instruction set here has the packed bf16 linear kernel (AVX-512 BF16)")


@pytest.fixture(scope="module")
def every_isa(module) -> dict[str, NativeCpuKernels]:
    """Attention tests run each input through every runnable instruction set, so the
    (slow) reference is computed once per input."""
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(module)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    atol, rtol = TOL[dtype]
    assert not actual.isnan().any(), f"{what}: output left unwritten (NaN poison survived)"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---- paged attention ------------------------------------------------------------------


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 7,
    head_major: bool = False,
):
    """Inputs for a batch of (q_len, seq_len) sequences with shuffled block ids.

    The cache holds random data everywhere (also in blocks no sequence owns), and the
    block tables' unused columns hold random valid ids, so reading anything not asked
    for shows up as a mismatch.  ``head_major``: the caches are views of
    [blocks, kv heads, block_size, head] storage, as the CPU platform allocates them.
    """
    need = [(ctx + block_size - 1) // block_size for _, ctx in seqs]
    num_blocks = sum(need) + spare_blocks
    shape = (
        (num_blocks, num_kv_heads, block_size, head_size)
        if head_major
        else (num_blocks, block_size, num_kv_heads, head_size)
    )
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    if head_major:
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    max_blocks = max(need) + 2
    block_tables = torch.randint(0, num_blocks, (len(seqs), max_blocks), generator=gen, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    start = 0
    for i, n in enumerate(need):
        block_tables[i, :n] = ids[start : start + n]
        start += n
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc


@contextlib.contextmanager
def num_threads(n: int):
    """torch's thread count set to n for the block (the kernels share torch's pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_attention(every_isa: dict[str, NativeCpuKernels], args, dtype: torch.dtype) -> None:
    scale = args[0].shape[-1] ** -0.5
    expected = reference.paged_attention(*args, scale)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        got = kernels.paged_attention(*args, scale, out)
        assert got is out
        assert_close(got, expected, dtype, isa)


# A decode, a first prefill chunk, a prefix-cache continuation (q tokens are the last
# q_len positions), a long decode crossing many blocks, and block-aligned edges.
MIXED = [(1, 37), (23, 23), (20, 300), (1, 700), (16, 64), (1, 1), (5, 48)]


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_paged_attention_mixed_batch(every_isa, head_size, dtype, block_size, heads):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((head_size, dtype, block_size, heads)).encode()))
    args = make_batch(MIXED, heads[0], heads[1], head_size, block_size, dtype, gen)
    check_attention(every_isa, args, dtype)


@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_head_major_cache(every_isa, head_size, dtype, threads):
    """The CPU platform's caches: reference-shaped views of head-major storage (each kv
    head's rows of a block contiguous), read through their strides; long decodes split
    along the keys with 2 threads."""
    gen = torch.Generator().manual_seed(head_size * 3 + threads)
    args = make_batch([*MIXED, (1, 1500)], 9, 3, head_size, 16, dtype, gen, head_major=True)
    assert not args[1].is_contiguous() and args[1].stride(2) == 16 * head_size
    with num_threads(threads):
        check_attention(every_isa, args, dtype)


@pytest.mark.parametrize("block_size", [1, 8, 128])
@pytest.mark.parametrize("heads", [(14, 2), (16, 2)], ids=["gqa7", "gqa8"])
def test_paged_attention_odd_blocks_and_wide_groups(every_isa, block_size, heads):
    gen = torch.Generator().manual_seed(block_size)
    args = make_batch(MIXED, heads[0], heads[1], 64, block_size, torch.bfloat16, gen)
    check_attention(every_isa, args, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "seqs",
    [[(1, 3001)], [(200, 2500)], [(1, 2049), (1, 5)], [(64, 64), (64, 1100)]],
    ids=["long-decode", "long-prefill-chunk", "long-and-short", "two-prefills"],
)
def test_paged_attention_long_contexts(every_isa, dtype, threads, seqs):
    """Long contexts: with 2 threads these are split along the keys and merged."""
    gen = torch.Generator().manual_seed(7)
    args = make_batch(seqs, 9, 3, 64, 16, dtype, gen)
    with num_threads(threads):
        check_attention(every_isa, args, dtype)


def test_paged_attention_default_model_decode_batch(every_isa):
    """The default model's shape (9 heads, 3 kv heads, head 64, bf16): 12 decodes."""
    gen = torch.Generator().manual_seed(3)
    seqs = [(1, int(n)) for n in torch.randint(1, 600, (12,), generator=gen)]
    check_attention(every_isa, make_batch(seqs, 9, 3, 64, 16, torch.bfloat16, gen), torch.bfloat16)


def test_paged_attention_strided_query_and_out_none(kernels):
    """query as a view into a fused qkv buffer; out=None allocates."""
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, bt, sl, qsl = make_batch(MIXED, 9, 3, 64, 16, torch.float32, gen)
    qkv = torch.randn(q.shape[0], (9 + 6) * 64, generator=gen)
    qkv[:, : 9 * 64] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : 9 * 64].view(q.shape[0], 9, 64)
    assert not q_view.is_contiguous()
    got = kernels.paged_attention(q_view, kc, vc, bt, sl, qsl, 0.125)
    assert_close(got, reference.paged_attention(q, kc, vc, bt, sl, qsl, 0.125), torch.float32)


def test_paged_attention_int64_metadata_and_empty_sequence(kernels):
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, bt, sl, qsl = make_batch([(3, 40), (0, 0), (1, 17)], 4, 2, 64, 16, torch.float32, gen)
    expected = reference.paged_attention(q, kc, vc, bt, sl, qsl, 0.3)
    got = kernels.paged_attention(q, kc, vc, bt.long(), sl.long(), qsl.long(), 0.3)
    assert_close(got, expected, torch.float32)


def test_paged_attention_unsupported_head_size_uses_reference(every_isa):
    gen = torch.Generator().manual_seed(2)
    args = make_batch(MIXED, 4, 2, 48, 16, torch.float32, gen)
    check_attention(every_isa, args, torch.float32)


def test_paged_attention_rejects_bad_metadata(kernels):
    gen = torch.Generator().manual_seed(4)
    q, kc, vc, bt, sl, qsl = make_batch([(1, 40)], 4, 2, 64, 16, torch.float32, gen)
    bt[0, 1] = kc.shape[0]  # out of range block id
    with pytest.raises(ValueError, match="block id"):
        kernels.paged_attention(q, kc, vc, bt, sl, qsl, 0.1)
    with pytest.raises(ValueError, match="shorter"):
        kernels.paged_attention(q, kc, vc, bt, torch.tensor([0], dtype=torch.int32), qsl, 0.1)


# ---- reshape_and_cache ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_reshape_and_cache(kernels, dtype, num_tokens, head_major):
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (64, 3, 16, 64) if head_major else (64, 16, 3, 64)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    if head_major:  # the CPU platform's caches: views of head-major storage
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    # key/value as strided views of a fused projection output, as a model produces them.
    kv = torch.randn(num_tokens, 2 * 3 * 64 + 5, generator=gen).to(dtype)
    key = kv[:, : 3 * 64].view(num_tokens, 3, 64)
    value = kv[:, 3 * 64 : 6 * 64].view(num_tokens, 3, 64)
    slots = torch.randperm(64 * 16, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    exp_k, exp_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, exp_k) and torch.equal(value_cache, exp_v)


def test_reshape_and_cache_rejects_out_of_range_slot(kernels):
    cache = torch.randn(4, 16, 2, 64)
    kv = torch.randn(2, 2, 64)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.reshape_and_cache(kv, kv, cache, cache.clone(), torch.tensor([3, 64]))
    assert torch.equal(cache, before), "nothing may be written when a slot is invalid"


# ---- row-wise ops ------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 576), (7, 3, 577), (300, 64)])
def test_rms_norm(kernels, dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen).to(dtype) * 3
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    assert_close(kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 576), (7, 3, 577), (300, 64)])
def test_fused_add_rms_norm(kernels, dtype, shape):
    gen = torch.Generator().manual_seed(shape[0] + 1)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    exp_out, exp_res = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    got_out, got_res = kernels.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert_close(got_res, exp_res, dtype)
    assert_close(got_out, exp_out, dtype)


def test_fused_add_rms_norm_aliased_inputs(kernels):
    """x and residual being one tensor must not turn the in-place kernel into garbage."""
    x = torch.randn(4, 576)
    weight = torch.randn(576)
    exp_out, exp_res = reference.fused_add_rms_norm(x, x, weight, 1e-5)
    same = x.clone()
    got_out, got_res = kernels.fused_add_rms_norm(same, same, weight, 1e-5)
    assert_close(got_out, exp_out, torch.float32)
    assert_close(got_res, exp_res, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (80, 80), (64, 32)])
def test_rotary_embedding(kernels, dtype, head_size, rot_dim):
    gen = torch.Generator().manual_seed(head_size + rot_dim)
    tokens, max_pos = 19, 512
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (9 + 3 + 3) * head_size, generator=gen).to(dtype)
    query = qkv[:, : 9 * head_size].view(tokens, 9, head_size)
    key = qkv[:, 9 * head_size : 12 * head_size].view(tokens, 3, head_size)
    exp_q, exp_k = reference.rotary_embedding(positions, query, key, cos_sin)
    got_q, got_k = kernels.rotary_embedding(positions, query, key, cos_sin)
    assert_close(got_q, exp_q, dtype)
    assert_close(got_k, exp_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 3, 2 * 37), (300, 2 * 64)])
def test_silu_and_mul(kernels, dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n", [(1, 5), (3, 16), (4, 49152), (64, 1001)])
def test_argmax(kernels, dtype, rows, n):
    """First index of the maximum per row, as torch.argmax: vector bodies and scalar
    tails, a repeated maximum, a row of -inf, NaNs (the first wins over any number)."""
    gen = torch.Generator().manual_seed(rows * 7919 + n)
    x = (torch.randn(rows, n, generator=gen) * 5).to(dtype)
    x[0, n - 1] = x.max() + 1  # the last element: a scalar tail or the end of a vector
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, n // 2] = x[2, n - 1] = x.max() + 1  # tie: the earlier one
        x[3 if rows > 3 else 2, n - 1] = float("nan")
        x[3 if rows > 3 else 2, 0] = float("inf")
    want = reference.argmax(x)
    got = kernels.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got.tolist()[:8], want.tolist()[:8])
    wide = torch.cat([x, torch.randn(rows, 3, generator=gen).to(dtype)], dim=1)  # row-strided view
    assert torch.equal(kernels.argmax(wide[:, :n]), want)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 100, 5), (4, 64, 1), (5, 576, 130), (16, 1536, 70), (7, 33, 9)])
def test_linear_few_rows(kernels, m, k, n, bias):
    """bf16 decode-sized linear (the skinny kernel where the ISA has one) against the
    float32 reference rounded to bf16: K tails, N tails, row blocks of 1-4, bias."""
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = reference.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    assert_close(kernels.linear(x, w, b), want, torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 960), (5, 64, 16), (6, 100, 48), (13, 1536, 576), (64, 576, 80), (130, 34, 1040)]
)
def test_packed_linear(packed_kernels, m, k, n, bias):
    """The packed bf16 kernel (weights [N/16, K/2, 16, 2]) against the float32
    reference rounded to bf16: row tiles of 1-6 and their tails, 1-4 column blocks,
    row chunks across threads, bias; row-strided x and 3-D x."""
    from pagedserve.kernels.cpu.native import unpack_linear_weight

    kernels = packed_kernels

    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    wide = torch.randn(m, k + 3, generator=gen).bfloat16()
    x = wide[:, :k]  # a row-strided view
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = kernels.pack_linear_weight(w)
    assert packed.shape == (n // 16, k // 2, 16, 2) and torch.equal(unpack_linear_weight(packed), w)
    want = reference.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    got = kernels.packed_linear(x, packed, b)
    assert_close(got, want, torch.bfloat16)
    assert torch.equal(kernels.packed_linear(x.reshape(1, m, k), packed, b), got.view(1, m, n))
    xf = x.float()  # another dtype: the reference on the unpacked weight
    assert_close(
        kernels.packed_linear(xf, packed, None if b is None else b.float()),
        reference.linear(xf, w.float(), None if b is None else b.float()),
        torch.float32,
    )


@pytest.mark.parametrize(
    "m,k,n,gated",
    [(1, 576, 576, False), (4, 1536, 576, False), (11, 64, 144, False), (2, 34, 16, False), (3, 64, 160, True)],
)
def test_packed_linear_split_over_threads(packed_kernels, m, k, n, gated):
    """Up to 11 rows with whole tiles splitting unevenly over the threads (9 tiles of
    the default model's o and down on 2 threads; 9 blocks in 3 tiles; gated: 5 output
    blocks), each thread takes an equal run of 16-column blocks: outputs bit-identical
    to one thread's and close to the reference (a column left unwritten would not be)."""
    kernels = packed_kernels
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(w)
    fn = kernels.packed_linear_silu_and_mul if gated else kernels.packed_linear
    if gated:  # the [m, n] product rounded to bf16 before the SiLU, as the kernel does
        want = reference.linear_silu_and_mul(x, w, b)
    else:
        want = reference.linear(x.float(), w.float(), b.float()).bfloat16()
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(fn(x, packed, b))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], want, torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,d", [(1, 576, 1536), (7, 64, 48), (13, 100, 16), (64, 576, 96), (130, 34, 32)])
def test_packed_linear_silu_and_mul(packed_kernels, m, k, d, bias):
    """The gated packed kernel (silu(x . gate^T) * (x . up^T) without writing the 2d
    product): bit-identical to the packed linear followed by silu_and_mul, and close to
    the reference; 1-2 gate blocks per tile (d/16 even and odd), row tails, bias,
    row-strided and 3-D x, and the unpacked fallback for float32 x."""
    kernels = packed_kernels
    gen = torch.Generator().manual_seed(m * 1000 + k + d)
    wide = (torch.randn(m, k + 5, generator=gen) * 2).bfloat16()
    x = wide[:, :k]  # a row-strided view
    w = (torch.randn(2 * d, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(2 * d, generator=gen).bfloat16() if bias else None
    packed = kernels.pack_linear_weight(w)
    got = torch.full((m, d), float("nan")).bfloat16()
    got.copy_(kernels.packed_linear_silu_and_mul(x, packed, b))
    assert torch.equal(got, kernels.silu_and_mul(kernels.packed_linear(x, packed, b)))
    assert_close(got, reference.linear_silu_and_mul(x, w, b), torch.bfloat16)
    assert torch.equal(kernels.packed_linear_silu_and_mul(x.reshape(1, m, k), packed, b), got.view(1, m, d))
    xf = x.float()
    assert_close(
        kernels.packed_linear_silu_and_mul(xf, packed, None if b is None else b.float()),
        reference.linear_silu_and_mul(xf, w.float(), None if b is None else b.float()),
        torch.float32,
    )


def test_bf16_rounding_special_values(every_isa):
    """Every instruction set rounds float32 results to bf16 bit for bit as torch does,
    including where the AVX-512 BF16 conversion instruction differs (denormal results,
    NaNs), overflow to infinity and ties.  silu_and_mul with gate 100.5 (silu
    exact, 8 significant bits) rounds the float32 product 100.5 * up, which needs up to
    15 bits; up = +-2^-133 (the smallest bf16 denormal) makes a denormal tie."""
    tiny = 2.0**-133
    ups = torch.tensor(
        [
            tiny,
            -tiny,
            3 * tiny,
            1e-39,
            -1e-39,
            1.1754942e-38,
            float("inf"),
            float("-inf"),
            float("nan"),
            0.0,
            -0.0,
            3.0e38,
            -3.3e36,
            1.00390625,
            -1.01171875,
        ]
    )
    up = torch.cat([ups, torch.randn(40) * 1e-38, torch.randn(41)]).bfloat16()
    x = torch.cat([torch.full_like(up, 100.5), up]).view(1, -1)
    want = reference.silu_and_mul(x)
    assert want.isnan().any() and want.isinf().any()
    assert ((want.float().abs() < 1.1754942e-38) & (want != 0)).any()  # a denormal result
    nan = want.isnan()
    for isa, kernels in every_isa.items():
        got = kernels.silu_and_mul(x)
        # NaN payloads are not part of the contract (torch's own vector and scalar
        # conversions write different ones); everything else is, bit for bit.
        bits, want_bits = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
        assert torch.equal(got.isnan(), nan) and torch.equal(bits, want_bits), (
            isa,
            (bits != want_bits).nonzero().flatten().tolist(),
        )


def test_pack_linear_weight_refuses_other_shapes(every_isa):
    for isa, kernels in every_isa.items():
        if not kernels.has_packed_linear:  # only AVX-512 BF16 has the kernel
            assert kernels.pack_linear_weight(torch.randn(32, 64).bfloat16()) is None, isa
            continue
        assert kernels.pack_linear_weight(torch.randn(32, 64).bfloat16()).shape == (2, 32, 16, 2)
        assert kernels.pack_linear_weight(torch.randn(40, 64).bfloat16()) is None  # N % 16
        assert kernels.pack_linear_weight(torch.randn(32, 33).bfloat16()) is None  # K % 2
        assert kernels.pack_linear_weight(torch.randn(32, 64)) is None  # float32


def test_linear_strided_rows_and_large_batches(kernels):
    """A row-strided x (a view into a wider tensor) is read in place; batches above
    LINEAR_MAX_ROWS and other dtypes take torch's GEMM."""
    from pagedserve.kernels.cpu.native import LINEAR_MAX_ROWS

    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 200, generator=gen).bfloat16()
    x = wide[:, :128]
    w = torch.randn(40, 128, generator=gen).bfloat16()
    assert_close(kernels.linear(x, w), reference.linear(x.float(), w.float()).bfloat16(), torch.bfloat16)
    big = torch.randn(LINEAR_MAX_ROWS + 3, 128, generator=gen).bfloat16()
    assert_close(kernels.linear(big, w), reference.linear(big, w), torch.bfloat16)
    xf = torch.randn(2, 128, generator=gen)
    assert_close(kernels.linear(xf, w.float()), reference.linear(xf, w.float()), torch.float32)


# ---- selection and registration -----------------------------------------------------------


def test_choose_isa():
    features = frozenset({"avx2", "fma", "f16c"})
    compiled = ["avx512bf16", "avx512", "avx2", "scalar"]
    assert choose_isa(compiled, features) == "avx2"
    assert choose_isa(compiled, features, "scalar") == "scalar"
    with pytest.raises(ValueError, match="avx512"):
        choose_isa(compiled, features, "avx512")


def test_isa_env_var_forces_avx2(module, monkeypatch):
    from pagedserve.platforms.cpu import CpuPlatform
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.ops import OpRegistry

    if "avx2" not in runnable_isas(module):
        pytest.skip("no AVX2 here")
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2")
    platform = CpuPlatform()  # reads its switches once, here
    assert platform.options.isa == "avx2"
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA")
    ops = OpRegistry()
    register_cpu_ops(ops, platform.options)
    assert ops.source("rms_norm") == "cpu-native(avx2)"
    assert load_cpu_kernels(preferred_isa="avx2").isa == "avx2"
    with pytest.warns(RuntimeWarning, match="PAGEDSERVE_CPU_ISA"):
        assert load_cpu_kernels(preferred_isa="no-such-isa").isa == runnable_isas(module)[0]


def test_register_cpu_ops_installs_native_ops(module, monkeypatch):
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.ops import OpRegistry

    monkeypatch.delenv("PAGEDSERVE_CPU_ISA", raising=False)
    # The static order; measured dispatch is tests/platforms/test_platform_cpu_tuning.py.
    monkeypatch.setenv("PAGEDSERVE_CPU_TUNE", "0")
    ops = OpRegistry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_cpu_ops(ops)
    for name in NATIVE_OPS:
        assert ops.source(name).startswith("cpu-native("), name
    from pagedserve.platforms.cpu.dense_ops import onednn_available

    native = load_cpu_kernels()
    if native.has_packed_linear or onednn_available():
        want = f"cpu-native-packed({native.isa})" if native.has_packed_linear else "onednn-prepack"
        assert ops.source("linear") == ops.source("prepare_linear_weight") == want
    else:
        assert ops.source("linear") == (native.source if native.has_linear else "reference")


def test_disabled_by_env(monkeypatch):
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.options import CpuOptions

    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert not CpuOptions.from_env().native_kernels
    ops = OpRegistry()
    register_cpu_ops(ops)
    assert all(src == "reference" for _, src in ops.table())
