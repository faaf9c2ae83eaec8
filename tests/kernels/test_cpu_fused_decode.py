"""The fused decode attention call (rotary, cache write and paged attention in one native
call, kernels/cpu/bindings.cpp ``rotary_paged_attention``) against the three native ops
it replaces and against the reference; the CPU platform's dispatch to it."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import native
from pagedserve.platforms.cpu.attention_ops import make_rotary_paged_attention
from pagedserve.platforms.ops import OpRegistry

NAN = float("nan")


def _rope(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1)


def _decode_batch(gen, dtype, contexts, heads=8, kv_heads=2, head=64, block_size=16, rot=64, head_major=True):
    """A decode step's inputs as a model hands them over: q/k/v strided views of one
    [n, (heads + 2 kv) * head] projection output, a head-major paged cache (the CPU
    platform's) with scattered blocks, tables whose unused entries name other blocks."""
    n = len(contexts)
    per_seq = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(per_seq) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 2
    tables = torch.randint(0, num_blocks, (n, width), generator=gen, dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    if head_major:
        shape = (num_blocks, kv_heads, block_size, head)
        kc = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
        vc = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
    else:
        shape = (num_blocks, block_size, kv_heads, head)
        kc, vc = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head, generator=gen).to(dtype)
    q, k, v = torch.split_with_sizes(qkv.view(n, heads + 2 * kv_heads, head), [heads, kv_heads, kv_heads], 1)
    pos = torch.tensor([c - 1 for c in contexts], dtype=torch.int64)
    slots = torch.stack([tables[i, p // block_size].long() * block_size + p % block_size for i, p in enumerate(pos)])
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return dict(
        positions=pos, query=q, key=k, value=v, cos_sin_cache=_rope(256, rot), key_cache=kc, value_cache=vc,
        slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl, scale=head**-0.5,
    )  # fmt: skip


def _copy(a: dict) -> dict:
    """Fresh copies of every tensor (q/k/v stay views of one fresh buffer)."""
    out = dict(a)
    q, k, v = a["query"], a["key"], a["value"]
    n = q.shape[0]
    qkv = torch.cat([q, k, v], dim=1).reshape(n, -1).clone()
    heads, kv = q.shape[1], k.shape[1]
    out["query"], out["key"], out["value"] = torch.split_with_sizes(qkv.view(n, heads + 2 * kv, -1), [heads, kv, kv], 1)
    for name in ("key_cache", "value_cache"):
        c = a[name]
        out[name] = c.transpose(1, 2).clone().transpose(1, 2) if c.stride(1) < c.stride(2) else c.clone()
    return out


def _three_ops(kernels, a: dict) -> torch.Tensor:
    q, k = kernels.rotary_embedding(a["positions"], a["query"], a["key"], a["cos_sin_cache"])
    kernels.reshape_and_cache(k, a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"])
    return kernels.paged_attention(
        q, a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"], a["scale"]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rot", [64, 32])
def test_fused_call_equals_the_three_native_ops_bit_for_bit(cpu_kernels, dtype, rot):
    gen = torch.Generator().manual_seed(rot)
    a = _decode_batch(gen, dtype, [1, 16, 17, 33, 70, 5, 129], rot=rot)
    b, r = _copy(a), _copy(a)
    before = native.OP_CALLS.get("rotary_paged_attention:native", 0)
    out = torch.full(a["query"].shape, NAN, dtype=dtype)
    got = cpu_kernels.rotary_paged_attention(**a, out=out)
    assert got is out and native.OP_CALLS["rotary_paged_attention:native"] == before + 1
    want = _three_ops(cpu_kernels, b)
    assert torch.equal(got, want)
    assert torch.equal(a["key_cache"], b["key_cache"]) and torch.equal(a["value_cache"], b["value_cache"])
    # And the reference, from the same inputs.
    ref = reference.rotary_paged_attention(**r)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(a["key_cache"], r["key_cache"], atol=tol, rtol=tol)
    assert torch.equal(a["value_cache"], r["value_cache"])


def test_bad_metadata_raises_before_anything_is_written(cpu_kernels):
    gen = torch.Generator().manual_seed(5)
    a = _decode_batch(gen, torch.bfloat16, [3, 40, 18])
    a["block_tables"][1, 1] = 10_000  # a block id outside the cache, in the visible range
    q0, kc0, vc0 = a["query"].clone(), a["key_cache"].clone(), a["value_cache"].clone()
    with pytest.raises(ValueError, match="block id 10000 out of range"):
        cpu_kernels.rotary_paged_attention(**a)
    assert torch.equal(a["query"], q0)  # not rotated
    assert torch.equal(a["key_cache"], kc0) and torch.equal(a["value_cache"], vc0)
    b = _decode_batch(gen, torch.bfloat16, [3, 40, 18])
    b["positions"] = b["positions"] + 300  # outside the 256-row cos/sin table
    kc0 = b["key_cache"].clone()
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        cpu_kernels.rotary_paged_attention(**b)
    assert torch.equal(b["key_cache"], kc0)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_eight_bit_cache_takes_the_separate_ops(cpu_kernels, kv_dtype):
    gen = torch.Generator().manual_seed(9)
    a = _decode_batch(gen, torch.bfloat16, [7, 20, 33], head_major=False)
    row = reference.kv_row_size(64, kv_dtype)
    shape = (*a["key_cache"].shape[:3], row)
    src = torch.randn(shape, generator=gen)
    kc = reference.quantize_kv_rows(src[..., :64], kv_dtype)
    vc = reference.quantize_kv_rows(torch.randn(shape, generator=gen)[..., :64], kv_dtype)
    a["key_cache"], a["value_cache"] = kc, vc
    r = {**a, "key_cache": kc.clone(), "value_cache": vc.clone()}
    r["query"], r["key"], r["value"] = a["query"].clone(), a["key"].clone(), a["value"].clone()
    before = native.OP_CALLS.get("rotary_paged_attention:native", 0)
    got = cpu_kernels.rotary_paged_attention(**a)
    assert native.OP_CALLS.get("rotary_paged_attention:native", 0) == before
    want = reference.rotary_paged_attention(**r)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_platform_op_fuses_decode_steps_only(cpu_kernels):
    """Decode steps go to the fused call, a batch with a prefill chunk to the registry's
    own three ops, and so does a decode whose measured attention is not the native
    kernel."""
    ops = OpRegistry()
    calls: list[str] = []

    def counting(name):
        fn = getattr(cpu_kernels, name)

        def op(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return op

    for name in ("rotary_embedding", "reshape_and_cache", "paged_attention"):
        ops.register(name, counting(name), source="test")
    native_decode = {"yes": True}
    fused = make_rotary_paged_attention(cpu_kernels, ops, lambda q, kc: native_decode["yes"])
    gen = torch.Generator().manual_seed(11)
    a = _decode_batch(gen, torch.bfloat16, [9, 30])
    want = reference.rotary_paged_attention(**_copy(a))
    before = native.OP_CALLS.get("rotary_paged_attention:native", 0)
    torch.testing.assert_close(fused(**a), want, atol=2e-2, rtol=2e-2)
    assert calls == [] and native.OP_CALLS["rotary_paged_attention:native"] == before + 1
    native_decode["yes"] = False
    a = _decode_batch(torch.Generator().manual_seed(11), torch.bfloat16, [9, 30])
    torch.testing.assert_close(fused(**a), want, atol=2e-2, rtol=2e-2)
    assert calls == ["rotary_embedding", "reshape_and_cache", "paged_attention"]
    # A prefill chunk: three query tokens in the second sequence.
    native_decode["yes"] = True
    calls.clear()
    a = _decode_batch(torch.Generator().manual_seed(12), torch.bfloat16, [9, 30, 30, 30])
    a["query_start_loc"] = torch.tensor([0, 1, 4], dtype=torch.int32)
    a["seq_lens"] = torch.tensor([9, 30], dtype=torch.int32)
    a["positions"] = torch.tensor([8, 27, 28, 29])
    bs, t = 16, a["block_tables"]
    a["slot_mapping"] = torch.tensor(
        [int(t[0, 8 // bs]) * bs + 8] + [int(t[1, p // bs]) * bs + p % bs for p in (27, 28, 29)]
    )
    a["block_tables"] = t[:2]
    want = reference.rotary_paged_attention(**_copy(a))
    torch.testing.assert_close(fused(**a), want, atol=2e-2, rtol=2e-2)
    assert calls == ["rotary_embedding", "reshape_and_cache", "paged_attention"]


def test_cpu_platform_registers_the_fused_op():
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.options import CpuOptions

    ops = OpRegistry()
    register_cpu_ops(ops, CpuOptions.from_env())
    if ops.source("paged_attention") == "reference":
        pytest.skip("no native kernels here")
    assert ops.source("rotary_paged_attention").endswith("+fused-decode")
