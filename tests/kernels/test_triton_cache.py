"""The Triton reshape_and_cache kernel against kernels/reference.py.

Runs under Triton's interpreter without a GPU (TRITON_INTERPRET=1, set before triton
is imported) and on the GPU when there is one.  Caches start full of random values so
that a skipped (-1) slot is checked to keep its old contents, and a write to the wrong
slot shows up against the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import cache  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def triton_cache_gen() -> torch.Generator:
    """A generator with a fresh seed per test (PAGEDSERVE_TEST_SEED fixes it)."""
    seed = int(os.environ.get("PAGEDSERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def make_inputs(num_tokens, num_kv_heads, head_size, block_size, num_blocks, dtype, cache_dtype, gen, num_skipped):
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    skipped = torch.randperm(num_tokens, generator=gen)[:num_skipped]
    slots[skipped] = -1
    return [t.to(DEVICE) for t in (key, value, key_cache, value_cache, slots)]


@pytest.mark.parametrize(
    "dtype, cache_dtype, num_kv_heads, head_size, block_size",
    [
        (torch.float32, torch.float32, 2, 64, 16),
        (torch.bfloat16, torch.bfloat16, 1, 80, 32),
        (torch.float16, torch.float16, 4, 96, 16),
        (torch.bfloat16, torch.bfloat16, 2, 128, 32),
        (torch.float16, torch.float16, 1, 256, 16),
        (torch.float32, torch.bfloat16, 2, 64, 16),  # converted on store
        (torch.float16, torch.float32, 2, 80, 32),
        (torch.bfloat16, torch.bfloat16, 40, 128, 16),  # several programs per token
    ],
)
def test_matches_reference_and_skips_minus_one(
    dtype, cache_dtype, num_kv_heads, head_size, block_size, triton_cache_gen
):
    key, value, key_cache, value_cache, slots = make_inputs(
        11, num_kv_heads, head_size, block_size, 5, dtype, cache_dtype, triton_cache_gen, num_skipped=3
    )
    exp_k, exp_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
    before_k, before_v = key_cache.clone(), value_cache.clone()

    cache.reshape_and_cache(key, value, key_cache, value_cache, slots)

    if cache_dtype.itemsize < dtype.itemsize and not ON_GPU:
        # The interpreter truncates float32 -> bfloat16 where GPUs (and torch) round to
        # nearest even: allow one unit in the last place there.
        tol = dict(atol=0.0, rtol=2.0**-7)
        torch.testing.assert_close(key_cache, exp_k, **tol)
        torch.testing.assert_close(value_cache, exp_v, **tol)
    else:
        # A copy (or an exact widening): results must match bit for bit.
        assert torch.equal(key_cache, exp_k)
        assert torch.equal(value_cache, exp_v)
    # Slots no token maps to (including those of the -1 tokens) keep their contents.
    written = torch.zeros(key_cache.shape[0] * key_cache.shape[1], dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    keep = ~written.view(key_cache.shape[:2])
    assert keep.sum() == key_cache.shape[0] * key_cache.shape[1] - 8
    assert torch.equal(key_cache[keep], before_k[keep])
    assert torch.equal(value_cache[keep], before_v[keep])


def test_all_slots_skipped_writes_nothing(triton_cache_gen):
    key, value, key_cache, value_cache, slots = make_inputs(
        4, 2, 64, 16, 2, torch.float16, torch.float16, triton_cache_gen, num_skipped=4
    )
    before_k, before_v = key_cache.clone(), value_cache.clone()
    cache.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_strided_key_and_value_views(triton_cache_gen):
    # key and value usually are views into one fused qkv projection.
    t, kvh, d = 6, 2, 64
    qkv = torch.randn(t, (4 + 2 * kvh) * d, generator=triton_cache_gen).to(torch.bfloat16).to(DEVICE)
    key = qkv[:, 4 * d : (4 + kvh) * d].view(t, kvh, d)
    value = qkv[:, (4 + kvh) * d :].view(t, kvh, d)
    _, _, key_cache, value_cache, slots = make_inputs(
        t, kvh, d, 16, 3, torch.bfloat16, torch.bfloat16, triton_cache_gen, num_skipped=1
    )
    exp_k, exp_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
    cache.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, exp_k) and torch.equal(value_cache, exp_v)


@pytest.mark.parametrize(
    "which, bad, match",
    [
        ("slot_mapping", lambda s: s.int(), "slot_mapping has dtype int32"),
        ("slot_mapping", lambda s: s[:-1], "slot_mapping has 3 entries for 4 tokens"),
        ("key", lambda k: k[:, :1], "key shape"),
        ("key_cache", lambda c: c[..., :32], "key_cache shape"),
        ("value_cache", lambda c: c.double(), "value_cache has dtype float64"),
        ("key", lambda k: k.transpose(0, 1).contiguous().transpose(0, 1)[..., ::2], "stride 1 in its last"),
        ("value", lambda v: v[0], "value must have 3 dimensions"),
    ],
)
def test_rejects_bad_inputs(which, bad, match):
    gen = torch.Generator().manual_seed(0)
    args = dict(
        zip(
            ("key", "value", "key_cache", "value_cache", "slot_mapping"),
            make_inputs(4, 2, 64, 16, 2, torch.float16, torch.float16, gen, num_skipped=1),
            strict=True,
        )
    )
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=match):
        cache.reshape_and_cache(**args)
