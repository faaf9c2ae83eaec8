"""Varlen paged attention in Triton for mixed prefill/decode batches.

Same contract as :func:`pagedserve.kernels.reference.paged_attention`.

Work decomposition.  The query tokens of every sequence are cut into blocks of
``BLOCK_Q`` tokens; one program handles one such block for one KV head, i.e. a tile of
``BLOCK_M = BLOCK_Q * group`` query rows (all query heads sharing that KV head), so
each key/value tile is loaded once for the whole group.  Programs find their sequence
by binary search over ``query_start_loc`` (no host sync, so a launch needs only the
tensor shapes): sequence ``i``'s first block has the global index
``query_start_loc[i] // BLOCK_Q + i``, which bounds the grid by
``num_tokens // BLOCK_Q + num_seqs``.

Keys are gathered ``TILE_N`` at a time through the block table, one physical block
lookup per key, so any block size works.  Softmax is online (running max and sum in
float32, base-2 exponentials) and both matmuls accumulate in float32.

Split-KV ("flash decoding").  A batch of few, long, decode-only sequences gives too few
programs to fill the GPU.  The split path adds a third grid axis that cuts each
sequence's keys into ``num_splits`` chunks; each program writes a partial output
normalised by its own softmax sum plus the log-sum-exp of its scores, and a reduce
kernel combines the chunks weighted by ``exp(lse_s - max lse)``.  See
:func:`choose_num_splits` for the heuristic.
"""

from __future__ import annotations

import functools
import math

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
    interpreter_enabled,
    kv_layout,
    next_power_of_2,
)
from pagedserve.kernels.triton.fp8 import fp8_to_float32

__all__ = [
    "paged_attention",
    "paged_attention_fixed_splits",
    "choose_num_splits",
    "MAX_HEAD_SIZE",
    "SPLIT_MIN_CONTEXT",
]

#: Largest head size the kernels accept (the accumulator tile lives in registers).
MAX_HEAD_SIZE = 256
#: The split path is considered only when the block table can address this many keys.
SPLIT_MIN_CONTEXT = 1024
#: Keys per split at least: below this the reduce pass costs more than it wins.
SPLIT_MIN_CHUNK = 512
MAX_SPLITS = 64
# Program count assumed under the interpreter, where there is no device to ask.
_INTERPRETER_SMS = 8
_LOG2E = 1.4426950408889634
_LOG2E_C: tl.constexpr = tl.constexpr(_LOG2E)  # the same, readable inside kernels
# The KV_FMT values (kernels/triton/_common.py), readable inside kernels.
_FLOAT: tl.constexpr = tl.constexpr(KV_FLOAT)
_INT8: tl.constexpr = tl.constexpr(KV_INT8)
_E5M2: tl.constexpr = tl.constexpr(KV_E5M2)


@triton.jit
def _find_seq_idx(qsl_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= q_block_idx."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_seqs,
    head_size,
    block_size,
    split_chunk,
    window,
    soft_cap,
    sinks_ptr,
    key_ends_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FMT: tl.constexpr,
    KV_ROWS: tl.constexpr,
    KEY_ENDS: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_local = q_block - (q_start // BLOCK_Q + seq)
    if q_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = q_local * BLOCK_Q + rows // GROUP  # position within this step's q tokens
    heads = kv_head * GROUP + rows % GROUP
    # BLOCK_M may exceed BLOCK_Q * GROUP when GROUP is not a power of two.
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_size
    tokens = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # Causal: the last query row of this block sees keys up to its own position.
    kv_end = context_len + tl.minimum((q_local + 1) * BLOCK_Q, q_len)
    row_end = context_len + q_pos + 1
    if KEY_ENDS:
        # Rows of a span attending both ways see keys up to their key_ends.
        row_end = tl.load(key_ends_ptr + tokens, mask=row_valid, other=0)
        kv_end = tl.maximum(kv_end, tl.max(row_end, 0))
    # With a window, the first row sees no key before win_lo, and table entries of
    # blocks wholly before it may name freed blocks (arbitrary content): never load them.
    win_lo = 0
    if WINDOW:
        win_lo = tl.maximum(context_len + q_local * BLOCK_Q - window + 1, 0)
    if SPLIT:
        kv_lo = win_lo + split * split_chunk
        kv_hi = tl.minimum(kv_end, kv_lo + split_chunk)
    else:
        kv_lo = win_lo
        kv_hi = kv_end
    q_abs = context_len + q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for start_n in range(kv_lo, kv_hi, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_hi
        phys = tl.load(bt_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        in_block = (offs_n % block_size).to(tl.int64)
        k_off = phys * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_off = phys * stride_vb + in_block * stride_vs + kv_head * stride_vh
        kv_mask = n_valid[None, :] & dim_valid[:, None]
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=tl.trans(kv_mask), other=0.0)
        if KV_FMT == _INT8:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FMT != _FLOAT:  # fp8 bytes (the cache's uint8 view), decoded exactly
            k = fp8_to_float32(k, KV_FMT == _E5M2)
            v = fp8_to_float32(v, KV_FMT == _E5M2)
        if KV_ROWS:
            # Each row ends with its float32 scale: element (off + head_size) / 4 of the
            # cache's float32 view (rows and strides are multiples of 4 bytes).
            ks = tl.load(k_scale_ptr + (k_off + head_size) // 4, mask=n_valid, other=0.0)
            vs = tl.load(v_scale_ptr + (v_off + head_size) // 4, mask=n_valid, other=0.0)
            k = k * ks[None, :]
            v = v * vs[:, None]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFT_CAP:
            # qk_scale = scale * log2(e): cap the natural-log score, then back to base 2.
            t = s * (qk_scale / _LOG2E_C) / soft_cap
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * t) - 1.0) * _LOG2E_C
        else:
            s = s * qk_scale
        if KEY_ENDS:
            visible = n_valid[None, :] & (offs_n[None, :] < row_end[:, None])
        else:
            visible = n_valid[None, :] & (offs_n[None, :] <= q_abs[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] > q_abs[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; subtract 0 instead so that
        # exp2(-inf - -inf) never produces NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SINKS and not SPLIT:
        # The sink logit (base 2 here) joins the denominator with no value; a split
        # run leaves it to the reduction, so it is counted once.
        sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0) * _LOG2E_C
        m_fin = tl.maximum(m_i, sink)
        a = tl.math.exp2(m_i - m_fin)
        acc = acc * a[:, None]
        l_i = l_i * a + tl.math.exp2(sink - m_fin)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        part = part_out_ptr + tokens[:, None] * stride_pt + heads[:, None] * stride_ph + split * stride_ps
        tl.store(part + dims[None, :], o, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + tokens * stride_lt + heads * stride_lh + split, lse, mask=row_valid)
    else:
        dst = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qsl_ptr,
    num_seqs,
    num_splits,
    head_size,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    sinks_ptr,
    SPLIT_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Tokens outside query_start_loc's range belong to no sequence: leave them
    # untouched, as the single-pass kernel does.
    if token < tl.load(qsl_ptr):
        return
    if token >= tl.load(qsl_ptr + num_seqs):
        return
    splits = tl.arange(0, SPLIT_PAD)
    dims = tl.arange(0, HEAD_PAD)
    s_valid = splits < num_splits
    t64 = token.to(tl.int64)
    lse = tl.load(part_lse_ptr + t64 * stride_lt + head * stride_lh + splits, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2E_C
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)  # empty splits have lse = -inf -> weight 0
    part = part_out_ptr + t64 * stride_pt + head * stride_ph
    o = tl.load(
        part + splits[:, None] * stride_ps + dims[None, :],
        mask=s_valid[:, None] & (dims[None, :] < head_size),
        other=0.0,
    )
    w_sum = tl.sum(w, 0)
    if SINKS:  # the sink's share of the denominator, once over all splits
        w_sum += tl.math.exp2(sink - m_safe)
    res = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(
        out_ptr + t64 * stride_ot + head * stride_oh + dims, res.to(out_ptr.dtype.element_ty), mask=dims < head_size
    )


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
    block_q: int = 1,
) -> int:
    """Number of KV splits for a launch (1 = single pass), from shapes alone.

    Splitting pays off only when the single-pass grid is smaller than the GPU and each
    program would walk a long context: decode-heavy batches (at most two query tokens
    per sequence on average) of few sequences whose block table addresses at least
    :data:`SPLIT_MIN_CONTEXT` keys.  The split count aims at two programs per SM and
    keeps each split at least :data:`SPLIT_MIN_CHUNK` keys long.

    ``max_context`` is ``block_tables.shape[1] * block_size``, an upper bound of every
    sequence's length, which is known without reading ``seq_lens`` on the host.
    """
    if num_seqs == 0 or num_tokens > 2 * num_seqs or max_context < SPLIT_MIN_CONTEXT:
        return 1
    # Programs that have work in the single-pass grid (the launch grid also holds
    # empty ones, which exit at once).
    programs = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_heads
    if programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, max_context // SPLIT_MIN_CHUNK, MAX_SPLITS))


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> None:
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("key_cache", key_cache, ndim=4, dtypes=KV_DTYPES, last_dim_contiguous=True)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=KV_DTYPES, last_dim_contiguous=True)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), last_dim_contiguous=True)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), contiguous=True)
    tensors = dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
        tensors["out"] = out
    check_same_device(**tensors)

    num_tokens, num_heads, head_size = query.shape
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache shape {tuple(key_cache.shape)} != value_cache shape {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    num_kv_heads = key_cache.shape[2]
    kv_layout("key_cache", key_cache, head_size)  # raises for a row width that fits no layout
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} is outside the supported range 1..{MAX_HEAD_SIZE}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries; expected num_seqs + 1 = {num_seqs + 1}"
        )
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float, got {scale!r}")


def _tile_config(decode_like: bool, group: int, head_pad: int, fp32_dot: bool) -> tuple[int, int, int]:
    """(BLOCK_M, TILE_N, num_warps) for a launch.

    Decode-like batches use the smallest tile tl.dot allows (16 rows) so that no rows
    are wasted beyond the GQA group; prefill-heavy batches use taller tiles to reuse
    each K/V tile across more query rows.  The values were chosen so that ptxas
    reports no register spills for sm_80 and sm_90a (checked by compiling ahead of
    time; see tests/kernels/test_triton_attention.py), not by timing.
    """
    if fp32_dot:
        block_m, tile_n = (16 if decode_like or head_pad > 128 else 32), 16
        num_warps = 8 if head_pad <= 128 else 4
    elif head_pad <= 64:
        block_m, tile_n, num_warps = (16, 32, 4) if decode_like else (64, 64, 8)
    elif head_pad <= 128:
        block_m, tile_n, num_warps = (16, 64, 8) if decode_like else (64, 32, 8)
    else:
        block_m, tile_n, num_warps = (16, 16, 4) if decode_like else (32, 16, 8)
    block_m = max(block_m, next_power_of_2(group))
    if block_m >= 64 and head_pad >= 128:
        tile_n = min(tile_n, 32)
    return block_m, tile_n, num_warps


def _keys_per_program(max_context: int, block_q: int, sliding_window: int | None) -> int:
    """Upper bound of the keys one program walks: the block table's reach, or with a
    window the window plus the rows of one query block (each program starts at its first
    row's window)."""
    if sliding_window is None:
        return max_context
    return min(max_context, sliding_window + block_q - 1)


def _check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """sinks [num_heads] as a contiguous float32 tensor on query's device, or None."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"sinks must be [num_heads={query.shape[1]}], got {tuple(sinks.shape)}")
    return sinks.to(device=query.device, dtype=torch.float32).contiguous()


def _check_key_ends(key_ends: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """key_ends [num_tokens] as a contiguous int32 tensor on query's device, or None.
    Their range ([position + 1, seq_len]) is the caller's contract: checking it here
    would cost a host sync per call."""
    if key_ends is None:
        return None
    if tuple(key_ends.shape) != (query.shape[0],):
        raise ValueError(f"key_ends must be [num_tokens={query.shape[0]}], got {tuple(key_ends.shape)}")
    return key_ends.to(device=query.device, dtype=torch.int32).contiguous()


def _use_fp32_dot(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """fp32 caches need exact fp32 products (not TF32); mixed query/cache dtypes meet
    in fp32; and the interpreter computes bf16 arithmetic on raw uint16 storage, so
    bf16 is upcast there too."""
    return (
        key_cache.dtype == torch.float32
        or query.dtype != key_cache.dtype
        or (key_cache.dtype == torch.bfloat16 and interpreter_enabled())
    )


def paged_attention_fixed_splits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` with the number of KV splits given (1 = single pass).

    For tests and benchmarks that must exercise one path; arguments as in
    :func:`paged_attention`, plus ``num_splits`` >= 1.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)
    _check_window_and_cap(sliding_window, soft_cap)
    sinks = _check_sinks(sinks, query)
    key_ends = _check_key_ends(key_ends, query)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_size))  # tl.dot needs K >= 16
    dot_fp32 = _use_fp32_dot(query, key_cache)
    block_m, tile_n, num_warps = _tile_config(num_tokens <= 2 * num_seqs, group, head_pad, dot_fp32)
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs
    # A span's rows see past the window's reach of one query block: bound by the table.
    window_bound = sliding_window if key_ends is None else None
    max_context = _keys_per_program(block_tables.shape[1] * block_size, block_q, window_bound)
    split = num_splits > 1
    split_chunk = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), tile_n) * tile_n

    if split:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        p_strides = part_out.stride()[:3]
        l_strides = part_lse.stride()[:2]
    else:
        part_out = part_lse = out  # unused by the kernel in this mode
        p_strides, l_strides = (0, 0, 0), (0, 0)

    grid = (num_q_blocks, num_kv_heads, num_splits)
    k_layout = kv_layout("key_cache", key_cache, head_size)
    v_layout = kv_layout("value_cache", value_cache, head_size)
    _paged_attention_kernel[grid](
        query,
        k_layout.values,
        v_layout.values,
        k_layout.scales,
        v_layout.scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        num_seqs,
        head_size,
        block_size,
        split_chunk,
        sliding_window or 0,
        soft_cap or 1.0,
        out if sinks is None else sinks,  # unused without sinks
        seq_lens if key_ends is None else key_ends,  # unused without key_ends
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        *p_strides,
        *l_strides,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        HEAD_PAD=head_pad,
        DOT_FP32=dot_fp32,
        SPLIT=split,
        WINDOW=sliding_window is not None,
        SOFT_CAP=soft_cap is not None,
        SINKS=sinks is not None,
        KV_FMT=k_layout.fmt,
        KV_ROWS=k_layout.rows_scaled,
        KEY_ENDS=key_ends is not None,
        num_warps=num_warps,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            query_start_loc,
            num_seqs,
            num_splits,
            head_size,
            *p_strides,
            *l_strides,
            out.stride(0),
            out.stride(1),
            out if sinks is None else sinks,
            SPLIT_PAD=next_power_of_2(num_splits),
            HEAD_PAD=next_power_of_2(head_size),
            SINKS=sinks is not None,
        )
    return out


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
    """Varlen causal attention over the paged KV cache for a mixed batch.

    query: [num_tokens, num_heads, head_size] (fp32/bf16/fp16, stride 1 in the last
        dim); the tokens of sequence i are query[query_start_loc[i]:query_start_loc[i+1]]
        and are its last q_len_i positions.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], one
        float dtype (may differ from query's; then products run in fp32), or
        float8_e4m3fn / float8_e5m2 (read exactly, products in fp32); or int8,
        float8_e4m3fn or float8_e5m2 [..., head_size + 4]: each row's values times the
        float32 scale after them (kernels/reference.py), products in fp32.
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs] (context
        length including the new tokens); query_start_loc: int32 [num_seqs + 1].
    out: optional [num_tokens, num_heads, head_size] float tensor to write into.
    sliding_window, soft_cap: as in the reference (keys within the window; scores
        capped by ``soft_cap * tanh(score / soft_cap)``); each compiles its own variant.
        With a window each program starts at its first query row's window, so table
        entries of blocks that slid out of every row's window are never read.
    sinks: optional float32 [num_heads] sink logits (GPT-OSS), in each row's softmax
        denominator; a split-KV run adds them once, in the reduction.
    key_ends: optional int32 [num_tokens]: each query row sees keys below its entry
        instead of up to its own position (a span attending both ways, as the
        reference); a program walks up to its rows' largest entry.
    Returns out in query's dtype (or out's, when given).  head_size <= 256.

    Chooses between the single-pass and split-KV kernels with
    :func:`choose_num_splits`, from shapes only (no host sync).
    """
    _check_window_and_cap(sliding_window, soft_cap)
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)
    num_tokens, num_heads, head_size = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    group = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_size))
    block_m, _, _ = _tile_config(num_tokens <= 2 * num_seqs, group, head_pad, _use_fp32_dot(query, key_cache))
    num_splits = choose_num_splits(
        num_tokens,
        num_seqs,
        num_kv_heads,
        max_context=_keys_per_program(
            block_tables.shape[1] * key_cache.shape[1], block_m // group, sliding_window if key_ends is None else None
        ),
        num_sms=_num_sms(query.device),
        block_q=block_m // group,
    )
    return paged_attention_fixed_splits(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        num_splits,
        out,
        sliding_window,
        soft_cap,
        sinks,
        key_ends,
    )
