"""Triton kernel writing new keys/values into the paged KV cache.

Same contract as :func:`pagedserve.kernels.reference.reshape_and_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import (
    FLOAT_DTYPES,
    KV_DTYPES,
    KV_E5M2,
    KV_FLOAT,
    KV_INT8,
    check_same_device,
    check_tensor,
    kv_layout,
    next_power_of_2,
)
from pagedserve.kernels.triton.fp8 import float32_to_fp8

__all__ = ["reshape_and_cache"]

# Upper bound on elements one program moves per tensor: keeps the tile in registers
# for wide models (e.g. 8 KV heads x 256) while still giving each program enough work.
_MAX_TILE_ELEMS = 4096
# The KV_FMT values, readable inside kernels.
_INT8: tl.constexpr = tl.constexpr(KV_INT8)
_E5M2: tl.constexpr = tl.constexpr(KV_E5M2)
_FLOAT: tl.constexpr = tl.constexpr(KV_FLOAT)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    KV_FMT: tl.constexpr,
    ROWS_SCALED: tl.constexpr,
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
    if ROWS_SCALED:
        # Per (token, head) row: s = absmax / top, the values x / s rounded into the
        # format, and s stored in the 4 bytes after them (element (offset + head_size) / 4
        # of the cache's float32 view), as reference.quantize_kv_rows.
        row_k = block * stride_kcb + offset * stride_kcs + heads * stride_kch
        row_v = block * stride_vcb + offset * stride_vcs + heads * stride_vch
        _store_scaled_rows(
            k.to(tl.float32), key_cache_ptr, k_scale_ptr, row_k, dims, heads, num_kv_heads, head_size, KV_FMT
        )
        _store_scaled_rows(
            v.to(tl.float32), value_cache_ptr, v_scale_ptr, row_v, dims, heads, num_kv_heads, head_size, KV_FMT
        )
    elif KV_FMT == _FLOAT:
        tl.store(dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
    else:
        # Unscaled fp8 (reference.quantize_kv): saturated at the largest finite value,
        # rounded to nearest even, written as bytes through the cache's uint8 view.
        tl.store(dst_k, float32_to_fp8(k.to(tl.float32), KV_FMT == _E5M2).to(tl.uint8), mask=mask)
        tl.store(dst_v, float32_to_fp8(v.to(tl.float32), KV_FMT == _E5M2).to(tl.uint8), mask=mask)


@triton.jit
def _store_scaled_rows(x, cache_ptr, scale_ptr, row, dims, heads, num_kv_heads, head_size, KV_FMT: tl.constexpr):
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)
    x = tl.where(mask, x, 0.0)
    if KV_FMT == _INT8:
        top = 127.0
    elif KV_FMT == _E5M2:
        top = 57344.0
    else:
        top = 448.0
    amax = tl.max(tl.abs(x), 1)
    # IEEE division (a plain `/` may be approximate on GPUs): the reference's bytes.
    s = tl.math.div_rn(amax, tl.full(amax.shape, top, tl.float32))
    s_safe = tl.where(s > 0.0, s, 1.0)
    y = tl.math.div_rn(x, s_safe[:, None])
    y = tl.where(s[:, None] > 0.0, y, 0.0)
    dst = cache_ptr + row[:, None] + dims[None, :]
    if KV_FMT == _INT8:
        # Round half to even: adding and removing 1.5 * 2^23 leaves the integer float32 rounds to.
        y = (y + 12582912.0) - 12582912.0
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(dst, y.to(tl.int8), mask=mask)
    else:
        tl.store(dst, float32_to_fp8(y, KV_FMT == _E5M2).to(tl.uint8), mask=mask)
    tl.store(scale_ptr + (row + head_size) // 4, s, mask=heads < num_kv_heads)


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
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], one dtype:
        a float one (a plain cast), or float8_e4m3fn / float8_e5m2 (reference.quantize_kv:
        saturating, round to nearest even); or int8, float8_e4m3fn or float8_e5m2
        [..., head_size + 4]: each row quantized with its float32 scale after it
        (reference.quantize_kv_rows).
    slot_mapping: int64 [num_tokens]; slot = block_id * block_size + offset; -1 skips
        the token.  Slots past the end of the cache are not checked (that would need a
        device sync); the caller guarantees them.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("key_cache", key_cache, ndim=4, dtypes=KV_DTYPES, last_dim_contiguous=True)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=KV_DTYPES, last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache shape {tuple(key_cache.shape)} != value_cache shape {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    num_tokens, num_kv_heads, head_size = key.shape
    if key_cache.shape[2] != num_kv_heads:
        raise ValueError(f"key has {num_kv_heads} heads but the cache holds {key_cache.shape[2]}")
    k_layout = kv_layout("key_cache", key_cache, head_size)
    v_layout = kv_layout("value_cache", value_cache, head_size)
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
        k_layout.values,
        v_layout.values,
        k_layout.scales,
        v_layout.scales,
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
        KV_FMT=k_layout.fmt,
        ROWS_SCALED=k_layout.rows_scaled,
    )
