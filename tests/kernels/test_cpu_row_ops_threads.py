"""The native row-wise CPU ops give identical results on one thread and on several.

Below a size threshold (``kSerialElems`` in kernels/cpu/bindings.cpp) a row op runs
inline on the calling thread; above it, its rows are split over torch's pool.  Rows are
independent, so the split must never change a value: each op is run at decode sizes
(inline) and at sizes past the threshold (split) with one and with two threads, and the
outputs must be bitwise equal, and close to the reference.  Fresh random inputs, outputs
compared bitwise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedserve.kernels import reference

pytestmark = pytest.mark.timeout(300)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD = 576, 1536, 9, 3, 64
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 1.6e-2)}


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_both(fn):
    """fn() with one thread and with two: both results (cloned)."""
    out = []
    for n in (1, 2):
        with num_threads(n):
            r = fn()
        out.append(tuple(t.clone() for t in r) if isinstance(r, tuple) else r.clone())
    return out


def same(a, b) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
        assert torch.equal(
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            y.view(torch.int16) if y.dtype == torch.bfloat16 else y,
        )


# Rows below and above the inline threshold for each op's row width.
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norms_split_invariant(cpu_kernels, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    res = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    one, two = run_both(lambda: cpu_kernels.rms_norm(x, w, 1e-5))
    same(one, two)
    torch.testing.assert_close(one, reference.rms_norm(x, w, 1e-5), atol=TOL[dtype][0], rtol=TOL[dtype][1])

    one, two = run_both(lambda: cpu_kernels.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5))
    same(one, two)
    want = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    for got, exp in zip(one, want, strict=True):
        torch.testing.assert_close(got, exp, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_rotary_split_invariant(cpu_kernels, tokens):
    g = torch.Generator().manual_seed(100 + tokens)
    q = torch.randn(tokens, HEADS, HEAD, generator=g).bfloat16()
    k = torch.randn(tokens, KV_HEADS, HEAD, generator=g).bfloat16()
    pos = torch.randint(0, 2048, (tokens,), generator=g)
    freqs = torch.outer(torch.arange(2048).float(), torch.rand(HEAD // 2, generator=g))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    one, two = run_both(lambda: cpu_kernels.rotary_embedding(pos, q.clone(), k.clone(), cos_sin))
    same(one, two)
    for got, exp in zip(one, reference.rotary_embedding(pos, q.clone(), k.clone(), cos_sin), strict=True):
        torch.testing.assert_close(got, exp, atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_silu_and_mul_split_invariant(cpu_kernels, rows):
    x = torch.randn(rows, 2 * INTER, generator=torch.Generator().manual_seed(200 + rows)).bfloat16()
    one, two = run_both(lambda: cpu_kernels.silu_and_mul(x))
    same(one, two)
    torch.testing.assert_close(one, reference.silu_and_mul(x), atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_argmax_split_invariant(cpu_kernels, rows):
    x = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(300 + rows))
    one, two = run_both(lambda: cpu_kernels.argmax(x))
    same(one, two)
    assert torch.equal(one, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_embedding_matches_reference(cpu_kernels, tokens, id_dtype, dtype):
    g = torch.Generator().manual_seed(400 + tokens)
    w = torch.randn(1000, HIDDEN, generator=g).to(dtype)
    ids = torch.randint(0, 1000, (tokens,), generator=g).to(id_dtype)
    ids[0] = 999  # the last row, where an off-by-one shows
    one, two = run_both(lambda: cpu_kernels.embedding(ids, w))
    same(one, two)
    same(one, reference.embedding(ids, w))


@pytest.mark.parametrize("bad", [1000, -1])
def test_embedding_rejects_ids_outside_the_vocabulary(cpu_kernels, bad):
    w = torch.randn(1000, 64)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        cpu_kernels.embedding(torch.tensor([3, bad]), w)


def test_embedding_other_shapes_use_the_reference(cpu_kernels):
    w = torch.randn(50, 64)
    ids = torch.randint(0, 50, (3, 4))
    same(cpu_kernels.embedding(ids, w), reference.embedding(ids, w))
    strided = torch.randn(64, 50).t()  # not contiguous
    same(cpu_kernels.embedding(ids[0], strided), reference.embedding(ids[0], strided))
