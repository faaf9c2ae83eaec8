"""Triton kernel writing new keys/values into the paged KV cache.

Same contract as :func:`pagedserve.kernels.reference.reshape_and_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    next_power_of_2,
)

__all__ = ["reshape_and_cache"]

# Upper bound on elements one program moves per tensor: keeps the tile in registers
# for wide models (e.g. 8 KV heads x 256) while still giving each program enough work.
_MAX_TILE_ELEMS = 4096


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    head_size,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head_start = tl.program_id(1) * HEADS_PER_PROG
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size

    heads = head_start + tl.arange(0, HEADS_PER_PROG)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)

    src_k = key_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)

    dst_k = key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    dst_v = value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    tl.store(dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache, in place.

    key, value: [num_tokens, num_kv_heads, head_size] (fp32/bf16/fp16; converted to
        the cache dtype on store).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], one dtype.
    slot_mapping: int64 [num_tokens]; slot = block_id * block_size + offset; -1 skips
        the token.  Slots past the end of the cache are not checked (that would need a
        device sync); the caller guarantees them.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache shape {tuple(key_cache.shape)} != value_cache shape {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    num_tokens, num_kv_heads, head_size = key.shape
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"key has {num_kv_heads} heads of size {head_size} but the cache holds "
            f"{key_cache.shape[2]} heads of size {key_cache.shape[3]}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return

    head_pad = next_power_of_2(head_size)
    heads_per_prog = min(next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_prog))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_size,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        HEADS_PER_PROG=heads_per_prog,
        HEAD_PAD=head_pad,
    )
