"""The latent (MLA) attention op: the reference against plain multi-head attention over
the decompressed keys and values it stands for, the registered op (the CPU platform's)
and the native CPU kernel (kernels/cpu/mla_attention.cpp) on the conformance cases."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native

from pagedserve.kernels import build, reference
from pagedserve.testing.checks import Check
from pagedserve.testing.op_checks import OP_CASES
from pagedserve.testing.target import select_target


def test_absorbed_latent_attention_equals_attention_over_decompressed_heads():
    """W_UK absorbed into the query and W_UV applied after attention give what decompressing
    each head's key [k_nope | k_rope] and value from the latent and attending gives."""
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, nope, v_dim, bs = 3, 20, 6, 10, 14, 4
    batch = ((9, 9), (13, 4), (6, 1))  # (context, new tokens): a prefill, a chunk, a decode
    ctx_total = sum(c for c, _ in batch)
    latent = torch.randn(ctx_total, rank, generator=gen)
    k_rope = torch.randn(ctx_total, rope, generator=gen)
    w_uk = torch.randn(heads, nope, rank, generator=gen) * 0.3
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) * 0.3
    n_q = sum(q for _, q in batch)
    q_nope = torch.randn(n_q, heads, nope, generator=gen)
    q_rope = torch.randn(n_q, heads, rope, generator=gen)
    scale = (nope + rope) ** -0.5
    # Each sequence's tokens in its own shuffled blocks.
    per_seq = [-(-c // bs) for c, _ in batch]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    half = (rank + rope + 1) // 2
    kc = torch.randn(num_blocks, bs, 1, half, generator=gen)  # garbage outside the written slots
    vc = torch.randn(num_blocks, bs, 1, half, generator=gen)
    dec_k = torch.randn(num_blocks, bs, heads, nope + rope, generator=gen)
    dec_v = torch.randn(num_blocks, bs, heads, nope + rope, generator=gen)
    start = 0
    for i, ((ctx, _), nb) in enumerate(zip(batch, per_seq)):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = tables[i].long()[pos // bs] * bs + pos % bs
        c, r = latent[start : start + ctx], k_rope[start : start + ctx]
        entry = torch.cat([c, r], dim=-1).view(ctx, 2, 1, half)
        reference.reshape_and_cache(entry[:, 0], entry[:, 1], kc, vc, slots)
        k_nope = torch.einsum("hdr,tr->thd", w_uk, c)
        v = torch.einsum("hvr,tr->thv", w_uv, c)
        k = torch.cat([k_nope, r[:, None].expand(ctx, heads, rope)], dim=-1)
        v = torch.cat([v, v.new_zeros(ctx, heads, nope + rope - v_dim)], dim=-1)
        reference.reshape_and_cache(k, v, dec_k, dec_v, slots)
        start += ctx
    seq_lens = torch.tensor([c for c, _ in batch], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor([q for _, q in batch]).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_attention(torch.cat([q_nope, q_rope], -1), dec_k, dec_v, tables, seq_lens, qsl, scale)
    want = want[..., :v_dim]
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    o = reference.mla_paged_attention(torch.cat([q_latent, q_rope], -1), kc, vc, tables, seq_lens, qsl, scale, rank)
    got = torch.einsum("nhr,hvr->nhv", o, w_uv)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mla_refuses_a_cache_that_cannot_hold_the_latent():
    q = torch.randn(2, 2, 10)
    kc = torch.randn(3, 4, 1, 4)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2]), 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        reference.mla_paged_attention(q, kc, kc.clone(), *args, 6)
    with pytest.raises(ValueError, match="one KV head"):
        reference.mla_paged_attention(q, torch.randn(3, 4, 2, 5), torch.randn(3, 4, 2, 5), *args, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_registered_mla_op_conforms(dtype):
    target = select_target("cpu")
    fn = target.ops.get("mla_paged_attention")
    results = [Check(d, b).run() for d, b in OP_CASES["mla_paged_attention"](target, fn, dtype, 0)]
    assert len(results) == 3 and all(r.status == "passed" for r in results), [r.message for r in results]


@pytest.mark.skipif(build.no_compiler_declared(), reason="PAGEDSERVE_NO_COMPILER=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_cpu_kernel_conforms(dtype):
    from pagedserve.kernels.cpu import mla_native

    require_native(mla_native.load_mla_kernels, mla_native.mla_build_spec, "the latent-attention CPU kernel")
    target = select_target("cpu")
    cases = OP_CASES["mla_paged_attention"](target, mla_native.mla_paged_attention, dtype, 0)
    results = [Check(d, b).run() for d, b in cases]
    assert len(results) == 3 and all(r.status == "passed" for r in results), [r.message for r in results]


def test_native_entry_hands_an_fp8_cache_and_bad_shapes_to_the_reference():
    """An 8-bit cache is read by the reference (the kernel reads one dtype); a cache too
    narrow for the query is refused as the reference refuses it."""
    from pagedserve.kernels.cpu import mla_native

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 10, generator=gen)
    kc, vc = torch.randn(2, 4, 1, 5, generator=gen), torch.randn(2, 4, 1, 5, generator=gen)
    tables, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    want = reference.mla_paged_attention(q, k8, v8, tables, lens, qsl, 0.5, 6)
    torch.testing.assert_close(mla_native.mla_paged_attention(q, k8, v8, tables, lens, qsl, 0.5, 6), want)
    with pytest.raises(ValueError, match="do not fit"):
        mla_native.mla_paged_attention(q, kc[..., :4], vc[..., :4], tables, lens, qsl, 0.5, 6)
