"""The CUDA C++ kernels behind the op-registry signatures of ``kernels/reference.py``.

The extension is built on first use (see :mod:`pagedserve.kernels.cuda.build`).  Where
the C++ kernels do not cover a call the ops fall back, loudly documented here rather
than silently elsewhere:

- paged_attention: the C++ kernel is a decode kernel; batches with more query tokens
  than sequences (prefill chunks) go to the Triton kernel, as do mixed query/cache
  dtypes (8-bit caches among them) and head sizes without a compiled kernel.  The C++
  kernel reads int8 and fp8 caches too (``paged_attention_decode``, checked against
  the reference by benchmarks/gpu_kernels.py), but has not yet run on a GPU, so these
  ops keep sending 8-bit caches to Triton until that check has passed on one.
- reshape_and_cache: the C++ kernel copies without converting; when the new keys'
  dtype differs from the cache's (an 8-bit cache: quantized, with or without row
  scales), the Triton kernel runs instead.
- copy_blocks / swap_blocks: pools that both live on the CPU use the reference.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cuda.build import load_cuda_extension

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`pagedserve.kernels.reference.paged_attention`.

    query: [num_tokens, num_heads, head_size]; key_cache, value_cache:
    [num_blocks, block_size, num_kv_heads, head_size]; block_tables int32
    [num_seqs, max_blocks]; seq_lens int32 [num_seqs]; query_start_loc int32
    [num_seqs + 1].  Returns out [num_tokens, num_heads, head_size].
    sliding_window / soft_cap: parameters of both the C++ decode kernel and the Triton
    kernel (each starts a query's key loop at its window, never reading slid-out blocks).
    sinks: float32 [num_heads] sink logits (GPT-OSS), a parameter of both kernels too.
    key_ends (spans attending both ways): the Triton kernel's only.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if sinks is not None:
        if tuple(sinks.shape) != (query.shape[1],):
            raise ValueError(f"sinks must be [num_heads={query.shape[1]}], got {tuple(sinks.shape)}")
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    ext = load_cuda_extension()
    num_tokens, _, head_size = query.shape
    same_dtype = query.dtype == key_cache.dtype == value_cache.dtype and (out is None or out.dtype == query.dtype)
    decode_shaped = num_tokens <= seq_lens.shape[0]
    if decode_shaped and same_dtype and key_ends is None and ext.supports_head_size(head_size):
        if out is None:
            out = torch.empty_like(query)
        ext.paged_attention_decode(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            float(scale),
            sliding_window or 0,
            float(soft_cap or 0.0),
            sinks,
        )
        return out
    from pagedserve.kernels.triton import attention

    return attention.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        key_ends=key_ends,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`pagedserve.kernels.reference.reshape_and_cache`.

    key, value: [num_tokens, num_kv_heads, head_size]; key_cache, value_cache:
    [num_blocks, block_size, num_kv_heads, head_size]; slot_mapping int64 [num_tokens].
    """
    if key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        load_cuda_extension().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    from pagedserve.kernels.triton import cache

    cache.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Same contract as :func:`pagedserve.kernels.reference.copy_blocks`.

    src_cache, dst_cache: contiguous [num_blocks, ...] pools of one dtype and block
    shape; mapping: int64 [n, 2] of (src_block, dst_block).  Within one device no
    destination block may also be a source of the same call (the copies run in
    parallel).  Copies that cross host and device are synchronous, like the
    reference: the current stream is synchronised before returning, so the host pool
    can be read or reused at once.
    """
    if mapping.numel() == 0:
        return
    mapping = mapping.to(torch.int64)
    if src_cache.is_cuda and dst_cache.device == src_cache.device:
        load_cuda_extension().copy_blocks(src_cache, dst_cache, mapping.to(src_cache.device).contiguous())
    elif src_cache.is_cuda or dst_cache.is_cuda:
        load_cuda_extension().swap_blocks(src_cache, dst_cache, mapping.cpu().contiguous())
        device = src_cache.device if src_cache.is_cuda else dst_cache.device
        torch.cuda.current_stream(device).synchronize()
    else:
        reference.copy_blocks(src_cache, dst_cache, mapping)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Same contract as :func:`copy_blocks`, between two pools (device <-> host)."""
    copy_blocks(src_cache, dst_cache, mapping)
