"""Pure-torch reference of every pagedserve kernel: this file is the specification.

Every other implementation (Triton, CUDA C++, the native CPU kernels, a plugin's
override) is tested against these functions on fresh random inputs.  They favour
clarity over speed, but avoid per-token Python loops so that they stay usable as the
fallback on platforms without a native kernel.

Layout of one layer's KV cache (the reference layout):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
A slot is ``block_id * block_size + offset``; slot ``-1`` means "do not write".
The cache's dtype is the model's, or an 8-bit one (a quantized KV cache).  Rows of a
quantized cache either carry their own scale or share a per-layer one:

* **Row-scaled** (int8 always; ``torch.float8_e4m3fn``/``torch.float8_e5m2`` by
  default): the last dimension is ``head_size + 4`` (:func:`kv_row_size`), the
  ``head_size`` 8-bit values followed by the 4 bytes of a float32 scale (native byte
  order), so one (token, kv head) row is ``q[0..head_size) * scale``.  The scale is
  computed on write, per token and head: ``absmax(row) / 127`` for int8, ``absmax(row) /
  the format's largest finite value`` for fp8 (:func:`quantize_kv_rows`).  Keeping the
  scales inside the block means everything that moves blocks as bytes (copies, the host
  tier, hand-offs, connectors) moves them too.  A cache is row-scaled exactly when its
  rows are ``head_size + 4`` wide (:func:`kv_rows_scaled`).
* **Unscaled fp8** (rows ``head_size`` wide): keys and values are written as
  :func:`quantize_kv` casts them (saturating, scale 1.0).  A per-layer scale (a
  checkpoint's ``k_scale``/``v_scale``) is applied around the ops, not inside them
  (pagedserve.models.layers.paged_attention).

Attention reads every cache as float32 (:func:`dequantize_kv`).

The quantized linear ops (``gguf_linear``, ``int8_linear``, ``w8a8_linear``,
``fp8_linear``) take a weight in its stored format; the formats and the computation are
specified in :mod:`pagedserve.kernels.quant_reference`, which these ops call.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import lora_reference, quant_reference, recurrent_reference, spec_reference

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "quantize_kv",
    "quantize_kv_int8",
    "quantize_kv_rows",
    "dequantize_kv",
    "kv_rows_scaled",
    "kv_row_size",
    "INT8_KV_SCALE_BYTES",
    "KV_SCALE_BYTES",
    "QUANTIZED_KV_TORCH_DTYPES",
    "mla_paged_attention",
    "SCALED_KV_TORCH_DTYPES",
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rotary_embedding",
    "rotary_paged_attention",
    "mrope_rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "quick_gelu",
    "encoder_attention",
    "fused_moe",
    "prepare_moe_weights",
    "copy_blocks",
    "swap_blocks",
    "linear",
    "prepare_linear_weight",
    "linear_silu_and_mul",
    "embedding",
    "argmax",
    "apply_token_bitmask",
    "gguf_linear",
    "prepare_gguf_weight",
    "gguf_linear_silu_and_mul",
    "gguf_linear_stacked",
    "gguf_embedding",
    "int8_linear",
    "w8a8_linear",
    "fp8_linear",
    "rejection_sample",
    "lora_linear",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_delta_rule",
    "gated_delta_rule_recurrent",
    "rms_norm_gated",
    "mamba2_ssd",
    "mamba2_ssd_step",
    "OP_NAMES",
]


#: The 8-bit float KV cache dtypes (a platform declares the ones it reads).
QUANTIZED_KV_TORCH_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: KV cache dtypes whose rows always carry a float32 scale after the values (head_size + 4
#: wide); an 8-bit float cache carries one when its rows are that wide (kv_rows_scaled).
SCALED_KV_TORCH_DTYPES: tuple[torch.dtype, ...] = (torch.int8,)
#: Bytes of the per-row scale of a row-scaled KV cache: one float32.
KV_SCALE_BYTES = 4
INT8_KV_SCALE_BYTES = KV_SCALE_BYTES


def kv_row_size(head_size: int, dtype: torch.dtype, scaled: bool | None = None) -> int:
    """The last dimension of a KV cache of ``dtype`` for ``head_size``: ``head_size + 4``
    for a row-scaled cache (the row's float32 scale rides along), else ``head_size``.
    ``scaled``: whether an 8-bit float cache is row-scaled (None: yes, the default); an
    int8 cache always is, other dtypes never."""
    if dtype in SCALED_KV_TORCH_DTYPES:
        if scaled is False:
            raise ValueError("an int8 KV cache always carries a scale per row")
        return head_size + KV_SCALE_BYTES
    if dtype in QUANTIZED_KV_TORCH_DTYPES and scaled is not False:
        return head_size + KV_SCALE_BYTES
    return head_size


def kv_rows_scaled(cache: torch.Tensor, head_size: int) -> bool:
    """Whether the rows of KV ``cache`` ``[..., row]`` carry a float32 scale: an int8 cache
    (whose rows must then be ``head_size + 4`` wide), or an 8-bit float one whose rows
    are ``head_size + 4`` wide."""
    row = cache.shape[-1]
    if cache.dtype in SCALED_KV_TORCH_DTYPES:
        if row != head_size + KV_SCALE_BYTES:
            raise ValueError(f"int8 KV rows must be head_size + 4 = {head_size + 4} wide, got {row}")
        return True
    return cache.dtype in QUANTIZED_KV_TORCH_DTYPES and row == head_size + KV_SCALE_BYTES


def quantize_kv_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x [..., d]`` -> int8 ``[..., d + 4]``: per row ``s = absmax(x) / 127`` (float32),
    the values ``round_half_even(x / s)`` (within [-127, 127]; all zero when ``s == 0``),
    then the 4 bytes of ``s``."""
    return quantize_kv_rows(x, torch.int8)


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., d]`` -> ``dtype`` ``[..., d + 4]`` (int8 or an 8-bit float): per row
    ``s = absmax(x) / top`` in float32, ``top`` 127 for int8 or the format's largest finite
    value (448 for e4m3, 57344 for e5m2); the values ``x / s`` (float32 division) rounded
    to nearest even into ``dtype`` and clamped to [-top, top] (all zero when ``s == 0``),
    then the 4 bytes of ``s``."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / top
    y = torch.where(s > 0, xf / s, torch.zeros_like(xf))
    if dtype == torch.int8:
        q = y.round_().clamp_(-top, top).to(torch.int8)
    else:
        q = y.clamp_(-top, top).to(dtype)
    return torch.cat([q, s.contiguous().view(dtype)], dim=-1)


def dequantize_kv(rows: torch.Tensor, head_size: int) -> torch.Tensor:
    """The float32 values ``[..., head_size]`` of KV cache rows ``[..., kv_row_size]`` (a
    row-scaled cache's ``q * s``; any other dtype widened exactly)."""
    if kv_rows_scaled(rows, head_size):
        s = rows[..., head_size:].contiguous().view(torch.float32)
        return rows[..., :head_size].float() * s
    return rows.float()


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the KV cache's ``dtype``: for an 8-bit float, clamped to its largest
    finite value, then cast with round to nearest even (a key beyond e5m2's 57344 is
    stored as 57344, never inf; NaN stays NaN); for other dtypes a plain cast."""
    if dtype in QUANTIZED_KV_TORCH_DTYPES:
        big = torch.finfo(dtype).max
        return x.float().clamp(-big, big).to(dtype)
    return x.to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache, in place.

    key, value: [num_tokens, num_kv_heads, head_size]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: int64 [num_tokens]; -1 skips the token (e.g. padding).
    A row-scaled cache ``[..., head_size + 4]`` (int8, or an 8-bit float one that wide)
    stores :func:`quantize_kv_rows` of each row; an unscaled 8-bit float cache stores
    :func:`quantize_kv` of the keys and values.
    """
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # (block, offset) indexing rather than a flat view: a platform may hand in caches
    # whose storage is not token-major (the CPU platform's are head-major views).
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if kv_rows_scaled(key_cache, key.shape[-1]):
        key_cache.index_put_((blocks, offsets), quantize_kv_rows(key, key_cache.dtype))
        value_cache.index_put_((blocks, offsets), quantize_kv_rows(value, value_cache.dtype))
        return
    key_cache.index_put_((blocks, offsets), quantize_kv(key, key_cache.dtype))
    value_cache.index_put_((blocks, offsets), quantize_kv(value, value_cache.dtype))


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

    query: [num_tokens, num_heads, head_size]; the tokens of sequence i are
        query[query_start_loc[i]:query_start_loc[i+1]] and are the *last* q_len_i
        positions of that sequence (prefill chunk, prefix-cache continuation or decode).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
        (already holding the keys/values of the new tokens), in query's dtype or an
        8-bit float (a quantized cache: its values are read exactly, as float32), or
        row-scaled int8 or 8-bit float ``[..., head_size + 4]`` read as ``q * scale``
        in float32 (:func:`dequantize_kv`).
    block_tables: int32 [num_seqs, max_blocks]
    seq_lens: int32 [num_seqs], context length including the new tokens.
    query_start_loc: int32 [num_seqs + 1]
    Returns out: [num_tokens, num_heads, head_size] in query's dtype.
    Accumulation is in float32.  Grouped-query attention when num_heads > num_kv_heads.
    sliding_window: if set, the query at position p sees only keys at positions
        p - sliding_window < k <= p (the window counts the query's own position), as
        Mistral v0.1 and Gemma 2/3's local layers.  No query of sequence i then sees a
        key before first_visible = max(0, ctx - q_len - sliding_window + 1), and
        block_tables[i, j] for j < first_visible // block_size may hold ANY block id
        (the KV manager frees slid-out blocks and points their entries at a null block
        whose content is arbitrary, NaN included): implementations must never read
        those blocks, i.e. start the key loop at block first_visible // block_size.
    soft_cap: if set, scores (after ``scale``) become soft_cap * tanh(score / soft_cap)
        before the softmax (Gemma 2).
    sinks: if set, float32 [num_heads]: a learned logit per query head that joins the
        softmax's denominator but contributes no value (GPT-OSS's attention sinks):
        probs = exp(s - m) / (sum exp(s - m) + exp(sinks[h] - m)), m the maximum over
        the scores AND the sink.  A split of the keys must count the sink exactly once.
    Implementations without these parameters must refuse them (TypeError), never
    ignore them.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [num_heads={num_heads}], got {tuple(sinks.shape)}")
    if key_ends is not None and tuple(key_ends.shape) != (num_tokens,):
        raise ValueError(f"key_ends must be [num_tokens={num_tokens}], got {tuple(key_ends.shape)}")
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        ends = None
        if key_ends is not None:
            ends = key_ends[q_start:q_end].to(device=query.device, dtype=torch.int64).view(q_len, 1)
            own = torch.arange(ctx - q_len + 1, ctx + 1, device=query.device).view(q_len, 1)
            if bool((ends < own).any()) or bool((ends > ctx).any()):
                raise ValueError(f"sequence {i}: key_ends must lie in [position + 1, seq_len={ctx}]")
        n_blocks = (ctx + block_size - 1) // block_size
        # Blocks wholly before the first key any query of this sequence sees may have
        # been freed (their table entries point at a null block of arbitrary content,
        # NaN included), so they are never gathered.
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, ctx - q_len - sliding_window + 1) // block_size
        k_start = first_block * block_size
        blocks = block_tables[i, first_block:n_blocks].long()
        row = key_cache.shape[3]
        k = dequantize_kv(key_cache[blocks].reshape(-1, num_kv_heads, row)[: ctx - k_start], head_size)
        v = dequantize_kv(value_cache[blocks].reshape(-1, num_kv_heads, row)[: ctx - k_start], head_size)
        q = query[q_start:q_end].float()
        # [kv_heads, group, q_len, d] x [kv_heads, d, ctx - k_start]
        qh = q.view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(qh, k.permute(1, 2, 0).unsqueeze(1)) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(q_len, 1)
        k_pos = torch.arange(k_start, ctx, device=query.device).view(1, ctx - k_start)
        masked = k_pos > q_pos if ends is None else k_pos >= ends
        if sliding_window is not None:
            masked |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(masked, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink is one more logit whose value row is zero
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [kvh, g, q_len, d]
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(out.dtype)
    return out


def mla_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal multi-head latent attention (DeepSeek's MLA, up-projections absorbed)
    over a latent paged cache, for a mixed batch as :func:`paged_attention` takes it.

    Each cached token is one vector of ``L = kv_lora_rank + rope_dim`` values: the normed
    KV latent then the rotated rope key, shared by every head.  It is stored split over
    the layer's ordinary (key, value) pair, one KV head of ``D = ceil(L / 2)`` each:
    ``concat(key_cache[token], value_cache[token])[:L]`` (the padding, if any, is never
    read), so allocation, swap and hand-off move it as any cache.
    query: [num_tokens, num_heads, L]: each head's query times its key up-projection
        (kv_lora_rank values) then its rotated rope query.
    key_cache, value_cache: [num_blocks, block_size, 1, D], holding the new tokens already
        (written by ``reshape_and_cache`` as the two halves); query's dtype or an 8-bit
        float (read exactly, as float32).
    block_tables, seq_lens, query_start_loc: as :func:`paged_attention`.
    score = scale * query . entry; the value is the entry's first ``kv_lora_rank`` values.
    Returns out: [num_tokens, num_heads, kv_lora_rank] in query's dtype (the caller applies
    each head's value up-projection).  Accumulation is in float32.
    """
    num_tokens, num_heads, width = query.shape
    block_size, kv_heads, half = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    if kv_heads != 1 or tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"a latent cache is one KV head in key and value alike, got {tuple(key_cache.shape)}")
    if not 0 < kv_lora_rank < width <= 2 * half:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} and query width {width} do not fit 2 x {half} cached values")
    if out is None:
        out = query.new_empty(num_tokens, num_heads, kv_lora_rank)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[i, : (ctx + block_size - 1) // block_size].long()
        k = key_cache[blocks].reshape(-1, half)[:ctx].float()
        v = value_cache[blocks].reshape(-1, half)[:ctx].float()
        entry = torch.cat([k, v], dim=-1)[:, :width]  # [ctx, L]
        q = query[q_start:q_end].float().transpose(0, 1)  # [heads, q_len, L]
        scores = torch.matmul(q, entry.t()) * scale  # [heads, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(q_len, 1)
        k_pos = torch.arange(ctx, device=query.device).view(1, ctx)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), entry[:, :kv_lora_rank])  # [heads, q_len, R]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, returned in x's dtype."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual).

    Implementations may update ``x`` and ``residual`` in place; callers must not
    reuse them afterwards except through the returned tensors.

    A float32 ``residual`` may come with a narrower ``x`` (bfloat16, float16): a float32
    residual stream beside low-precision activations (op capability
    ``float32_residual``, interface 1.7).  The sum is then computed and kept in float32,
    and the normalised row times ``weight`` is computed in float32 and rounded once to
    ``out_dtype``.  ``out_dtype`` (None: x's dtype) lets a float32 ``x`` (a projection
    that wrote its float32 sums unrounded) return the row in the activations' dtype.
    With ``residual`` in x's dtype and ``out_dtype`` None or x's dtype this is the
    plain op (its rounding steps unchanged).
    """
    out = x.dtype if out_dtype is None else out_dtype
    if residual.dtype == x.dtype and out == x.dtype:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual
    if residual.dtype != torch.float32:
        raise ValueError(
            f"fused_add_rms_norm: residual {residual.dtype} with x {x.dtype} and out_dtype {out}: only a float32 "
            "residual may differ from them"
        )
    residual = residual + x.float()
    return rms_norm(residual, weight, eps).to(out), residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (StarCoder2), computed in float32, returned in x's dtype.
    x [..., d]; weight, bias [d] (bias may be None)."""
    d = x.shape[-1]
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(x.float(), (d,), weight.float(), b, eps).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Llama/Qwen2 in transformers.

    positions: int64 [num_tokens]
    query: [num_tokens, num_heads, head_size]; key: [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: float32 [max_position, rotary_dim] = cat(cos, sin) over rotary_dim/2 each.
    Returns new (query, key) tensors in their input dtypes.
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x_rot, x_pass = xf[..., :rot], xf[..., rot:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        y = x_rot * cos + rotated * sin
        return torch.cat([y, x_pass], dim=-1).to(x.dtype)

    return apply(query), apply(key)


def rotary_paged_attention(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention layer's work after the q/k/v projection: :func:`rotary_embedding`
    of query and key, :func:`reshape_and_cache` of the rotated keys and the values,
    then :func:`paged_attention` of the rotated queries over the cache (no window, soft
    cap, sinks or key ends).

    positions int64 [num_tokens]; query [num_tokens, num_heads, head_size]; key, value
    [num_tokens, num_kv_heads, head_size]; cos_sin_cache float32 [max_position,
    rotary_dim]; the rest as those three ops take them.  Returns out [num_tokens,
    num_heads, head_size] in query's dtype; the caches hold the new keys and values.
    Implementations may rotate ``query`` and ``key`` in place (callers must not reuse
    them).  A platform fuses the three into one call where that saves work (the CPU's
    decode steps); the registry's default is the composition of its own three ops.
    """
    q, k = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(k, value, key_cache, value_cache, slot_mapping)
    return paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)


def mrope_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    mrope_section: list[int],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-VL's multimodal RoPE (M-RoPE), as transformers applies it: positions int64
    [3, num_tokens] (temporal, height, width); rotary frequency ``j`` (of rotary_dim / 2)
    turns by the temporal position for the first ``mrope_section[0]`` frequencies, the
    height for the next ``mrope_section[1]``, the width for the last ``mrope_section[2]``.
    ``interleaved`` (Qwen3-VL): the parts alternate instead -- frequency ``j`` turns by
    the height when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, by the width when
    ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, by the temporal position otherwise.
    Not an op of its own: the model picks each token's table rows and runs
    ``rotary_embedding``; this rotates by each of the three positions in full and keeps
    each frequency's pair of dims from its own part.  Other arguments as
    :func:`rotary_embedding`."""
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {mrope_section} does not add up to {half} frequencies")
    owner = []
    for part, count in enumerate(mrope_section):
        owner += [part] * count
    if interleaved:
        owner = [0] * half
        for j in range(half):
            if j % 3 == 1 and j < 3 * mrope_section[1]:
                owner[j] = 1
            elif j % 3 == 2 and j < 3 * mrope_section[2]:
                owner[j] = 2
    turned = [rotary_embedding(positions[c], query, key, cos_sin_cache) for c in range(3)]
    q_out, k_out = query.clone(), key.clone()
    for j, part in enumerate(owner):
        for col in (j, j + half):  # a frequency rotates dims j and j + rotary_dim / 2
            q_out[..., col] = turned[part][0][..., col]
            k_out[..., col] = turned[part][1][..., col]
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = cat(gate, up); returns silu(gate) * up, [..., d]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """x: [..., 2*d] = cat(gate, up); returns gelu(gate) * up, [..., d] (GeGLU, as Gemma's
    MLP).  approximate: "tanh" (transformers' gelu_pytorch_tanh) or "none" (exact erf)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of a non-gated MLP (StarCoder2): "tanh" approximation or "none" (erf)."""
    return torch.nn.functional.gelu(x, approximate=approximate)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: ``x * sigmoid(1.702 x)``, computed in float32, in x's dtype."""
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


def encoder_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional (non-causal) attention of a vision encoder over a varlen batch.

    query, key, value [num_tokens, num_heads, head_size]; cu_seqlens int32
    [num_seqs + 1] (each sequence's start, then the total): every token attends to every
    token of its own sequence.  Softmax in float32; returns [num_tokens, num_heads,
    head_size] in query's dtype.
    """
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = query[start:end].float().transpose(0, 1)  # [heads, n, d]
        k = key[start:end].float().transpose(0, 1)
        v = value[start:end].float().transpose(0, 1)
        probs = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """A mixture-of-experts MLP over routed tokens.

    x: [T, H]; w13: [E, 2*I, H] = each expert's cat(gate, up) rows; w2: [E, H, I];
    topk_weights: float32 [T, K]; topk_ids: int64 [T, K] (distinct experts per token).
    Returns [T, H] in x's dtype:
        out[t] = sum_k topk_weights[t, k] * w2[e] @ (act(gate_e @ x[t]) * (up_e @ x[t])),
        e = topk_ids[t, k]; act "silu" or "gelu" (tanh approximation).
    "swigluoai" (GPT-OSS, vLLM's name) replaces act(gate) * up by
        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
    w13_bias [E, 2*I] (cat(gate, up) like w13's rows) and w2_bias [E, H], when given,
    are added to each expert's products before the rounding (a biased linear).
    The expert products are rounded to x's dtype (as the dense linear ops do); the
    weighted sum over k is accumulated in float32.

    Tokens are grouped by expert so each active expert runs two GEMMs over its tokens;
    the Python loop is over active experts, never over tokens.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        b13 = None if w13_bias is None else w13_bias[expert]
        h = torch.nn.functional.linear(x.index_select(0, rows), w13[expert], b13)
        gate, up = h[:, :inter], h[:, inter:]
        if activation == "silu":
            h = torch.nn.functional.silu(gate) * up
        elif activation == "gelu":
            h = torch.nn.functional.gelu(gate, approximate="tanh") * up
        elif activation == "swigluoai":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        else:
            raise ValueError(f"fused_moe: activation {activation!r} is not supported (silu, gelu, swigluoai)")
        y = torch.nn.functional.linear(h, w2[expert], None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, rows, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)


def prepare_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights w13 [E, 2*I, H] and w2 [E, H, I] -> the forms the same
    registry's ``fused_moe`` takes, once at load (never on the step path).

    Reference: the weights themselves.  A platform may return other tensors (e.g. packed
    for its GEMM micro-kernels); ``fused_moe(x, *prepare_moe_weights(w13, w2), ...)`` must
    equal ``reference.fused_moe(x, w13, w2, ...)``.
    """
    return w13, w2


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy whole KV blocks: dst_cache[mapping[i, 1]] = src_cache[mapping[i, 0]].

    src_cache, dst_cache: [num_blocks, ...] (same block shape; may be the same tensor
    or live on different devices, e.g. a device pool and a host pool).
    mapping: int64 [n, 2] of (src_block, dst_block) pairs.
    """
    if mapping.numel() == 0:
        return
    if src_cache.dtype in QUANTIZED_KV_TORCH_DTYPES and src_cache.dtype == dst_cache.dtype:
        # The bytes themselves (index_copy_ has no 8-bit float kernel on the CPU).
        src_cache, dst_cache = src_cache.view(torch.uint8), dst_cache.view(torch.uint8)
    src_idx = mapping[:, 0].to(src_cache.device)
    dst_idx = mapping[:, 1].to(dst_cache.device)
    dst_cache.index_copy_(0, dst_idx, src_cache.index_select(0, src_idx).to(dst_cache.device))


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Same contract as copy_blocks, between two different pools (device <-> host)."""
    copy_blocks(src_cache, dst_cache, mapping)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias; weight [out_features, in_features], as returned by the same
    registry's ``prepare_linear_weight``."""
    return torch.nn.functional.linear(x, weight, bias)


def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense linear weight [out_features, in_features] -> the form the same registry's
    ``linear`` takes, once at load (never on the step path).

    Reference: the weight itself.  A platform may return another tensor (e.g. one
    pre-packed for its GEMM library); only its own ``linear`` needs to read it, and
    ``linear(x, prepare_linear_weight(w), b)`` must equal ``reference.linear(x, w, b)``.
    """
    return weight


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias)): a gated MLP's first half, weight [2*d, in]
    = cat(gate, up) as returned by the same registry's ``prepare_linear_weight``;
    returns [..., d].  The [..., 2*d] product is rounded to x's dtype before the SiLU,
    as the two ops in sequence do.

    An op registry's default is the composition of its own ``linear`` and
    ``silu_and_mul`` (so a platform that overrides only those gets them); a platform
    may fuse the two, never writing the 2*d intermediate."""
    return silu_and_mul(linear(x, weight, bias))


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """token_ids int64 [num_tokens]; weight [vocab, hidden] -> [num_tokens, hidden]."""
    return torch.nn.functional.embedding(token_ids, weight)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> int64 [rows]: the index of each row's largest value, the first one
    among equal maxima, a NaN counting as the largest (``torch.argmax``'s convention).
    Greedy sampling takes it of the logits where they were computed, so only the chosen
    ids leave the device."""
    return x.argmax(dim=-1)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """Set disallowed logits to -inf, in place; returns ``logits``.

    logits: [rows, vocab] float; bitmask: int32 [n, words], token j of a row allowed
    when bit ``j % 32`` of word ``j // 32`` is set (xgrammar's layout); indices: int64
    [n], the logits row each bitmask row applies to (None: row i to row i, n == rows).
    Columns past ``32 * words`` (logits padded beyond the vocabulary) are disallowed.
    Structured outputs mask the rows of constrained requests before sampling.
    """
    rows = torch.arange(bitmask.shape[0], device=logits.device) if indices is None else indices.long()
    vocab = logits.shape[1]
    cols = torch.arange(vocab, device=logits.device)
    words = bitmask.shape[1]
    word = bitmask.long()[:, (cols // 32).clamp(max=words - 1)]  # [n, vocab]
    allowed = ((word >> (cols % 32)) & 1).bool() & (cols < 32 * words)
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))
    return logits


def gguf_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    type_name: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias for W kept in GGUF blocks.

    x: [M, K] float32/bfloat16/float16; data: uint8 [N, K/32 * block_bytes], the ggml
    blocks of type_name ("Q4_0", "Q4_1" or "Q8_0") as the .gguf file stores them;
    bias: [N] or None.  Returns [M, N] in x.dtype, computed in float32.  An
    implementation may quantize x to int8 per 32-value block (as llama.cpp does); the
    conformance kit allows for that error.

    ``out_dtype`` (None: x's dtype) is the result's dtype: float32 returns the float32
    sums (+ bias) unrounded whatever x's dtype (op capability ``gguf_out_dtype``,
    interface 1.7), as a float32 x of the same values would give; a projection feeding
    a float32 residual stream writes it so.
    """
    return quant_reference.gguf_linear(x, data, type_name, bias, out_dtype)


def gguf_linear_silu_and_mul(
    x: torch.Tensor, data: torch.Tensor, type_name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu_and_mul(gguf_linear(x, data, type_name, bias)): a gated MLP's first half on
    GGUF blocks ``data`` [2*d, ...] = cat(gate, up), or their form from the same
    registry's ``prepare_gguf_weight``; returns [M, d] in x.dtype.  The [M, 2*d] product
    is rounded to x's dtype before the SiLU, as the two ops in sequence do.

    An op registry's default is the composition of its own ``gguf_linear`` and
    ``silu_and_mul``; a platform may fuse the two, never writing the 2*d intermediate."""
    return silu_and_mul(gguf_linear(x, data, type_name, bias))


def gguf_linear_stacked(
    x: torch.Tensor,
    data: list[torch.Tensor],
    type_names: list[str],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Several GGUF weights with one input, side by side: ``gguf_linear(x, data[i],
    type_names[i], bias_i, out_dtype)`` concatenated along the output, ``bias_i`` the
    part's slice of ``bias`` ``[sum N_i]`` (each part's float32 sum plus its bias rounded
    once); ``data[i]`` as the same registry's ``prepare_gguf_weight`` returned it.  A
    fused projection whose parts keep different block types (a Q5_K_M's [q; k] Q5_1
    beside a Q8_0 v) multiplies through it.

    An op registry's default is its own ``gguf_linear`` once per part; a platform may
    quantize x once and write every part's columns in place in one pass."""
    ys, at = [], 0
    for d, t in zip(data, type_names):
        n = d.numel() // quant_reference.gguf_row_bytes(t, x.shape[-1])  # a prepared form holds the blocks' bytes
        ys.append(gguf_linear(x, d, t, None if bias is None else bias[at : at + n], out_dtype))
        at += n
    return torch.cat(ys, dim=-1)


def prepare_gguf_weight(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """GGUF blocks uint8 ``[N, K/32 * block_bytes]`` of ``type_name`` -> the form the same
    registry's ``gguf_linear`` takes, once at load (never on the step path).

    Reference: the blocks themselves.  A platform may return another tensor (e.g. the
    blocks repacked for its GEMM); only its own ``gguf_linear`` needs to read it, and
    ``gguf_linear(x, prepare_gguf_weight(d, t), t, b)`` must equal
    ``reference.gguf_linear(x, d, t, b)`` within the op's tolerance.
    """
    return data


def gguf_embedding(ids: torch.Tensor, data: torch.Tensor, type_name: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[n]``) of GGUF blocks ``data`` of ``type_name``, or of their form
    from the same registry's ``prepare_gguf_weight``, dequantized -> ``[n, K]`` ``dtype``
    (an embedding lookup, so that a tied embedding and LM head share one prepared weight).

    Reference: the prepared form is the blocks themselves."""
    return quant_reference.dequantize_gguf(data.index_select(0, ids), type_name).to(dtype)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only INT8 (W8A16): y = x @ (qweight * scale[:, None]).T + bias.

    x: [M, K] float; qweight: int8 [N, K]; scale: float32 [N]; bias: [N] or None.
    Returns [M, N] in x.dtype.
    """
    return quant_reference.int8_linear(x, qweight, scale, bias)


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8: x quantized per row to int8 (symmetric, amax / 127, round half to even),
    integer products with qweight int8 [N, K], then both scales (scale float32 [N]).

    x: [M, K] float; bias: [N] or None.  Returns [M, N] in x.dtype.
    """
    return quant_reference.w8a8_linear(x, qweight, scale, bias)


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 weights: y = x @ (qweight * scale).T + bias.

    x: [M, K] float; qweight: float8_e4m3fn [N, K]; scale: float32 [] (per tensor) or
    [N] (per output channel); bias: [N] or None.  Returns [M, N] in x.dtype.  An
    implementation may quantize x to e4m3 per row (FP8 tensor-core GEMMs do); the
    conformance kit allows for that error.
    """
    return quant_reference.fp8_linear(x, qweight, scale, bias)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    recover_uniform: torch.Tensor,
) -> torch.Tensor:
    """Speculative decoding's verification of sampled rows: int64 ``[B, K + 1]``, each
    row's accepted drafts then one residual or bonus token, then -1.  Specified (shapes
    and randomness) in :mod:`pagedserve.kernels.spec_reference`."""
    return spec_reference.rejection_sample(
        draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform, recover_uniform
    )


def lora_linear(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Batched multi-LoRA delta, added to ``y`` in place: rows grouped by adapter slot
    (``-1``: none).  Specified in :mod:`pagedserve.kernels.lora_reference`."""
    return lora_reference.lora_linear(y, x, lora_a, lora_b, token_slots)


# -- recurrent layers (Gated DeltaNet, Mamba 1 and 2): specified in recurrent_reference ----
def causal_conv1d(x, weight, bias, conv_state, query_start_loc, has_state, activation="silu"):
    """Varlen causal depthwise convolution continuing each sequence's window (in place):
    x [num_tokens, dim] -> [num_tokens, dim].  See :func:`recurrent_reference.causal_conv1d`."""
    return recurrent_reference.causal_conv1d(x, weight, bias, conv_state, query_start_loc, has_state, activation)


def causal_conv1d_update(x, weight, bias, conv_state, activation="silu"):
    """One token per sequence: x [num_seqs, dim] -> [num_seqs, dim], window shifted in place.
    See :func:`recurrent_reference.causal_conv1d_update`."""
    return recurrent_reference.causal_conv1d_update(x, weight, bias, conv_state, activation)


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, use_qk_l2norm=True, chunk_size=64):
    """Chunked Gated DeltaNet over a varlen batch, states updated in place.
    See :func:`recurrent_reference.gated_delta_rule`."""
    return recurrent_reference.gated_delta_rule(q, k, v, g, beta, state, query_start_loc, use_qk_l2norm, chunk_size)


def gated_delta_rule_recurrent(q, k, v, g, beta, state, use_qk_l2norm=True):
    """Gated DeltaNet, one token per sequence (decode), states updated in place.
    See :func:`recurrent_reference.gated_delta_rule_recurrent`."""
    return recurrent_reference.gated_delta_rule_recurrent(q, k, v, g, beta, state, use_qk_l2norm)


def mamba2_ssd(x, dt, A, B, C, D, state, query_start_loc, chunk_size=256):
    """Mamba 2's chunked state-space scan over a varlen batch, states updated in place.
    See :func:`recurrent_reference.mamba2_ssd`."""
    return recurrent_reference.mamba2_ssd(x, dt, A, B, C, D, state, query_start_loc, chunk_size)


def mamba2_ssd_step(x, dt, A, B, C, D, state):
    """Mamba 2's state update, one token per sequence (decode), states updated in place.
    See :func:`recurrent_reference.mamba2_ssd_step`."""
    return recurrent_reference.mamba2_ssd_step(x, dt, A, B, C, D, state)


def mamba1_scan(x, dt, A, B, C, D, state, query_start_loc, chunk_size=16):
    """Mamba 1's selective scan over a varlen batch, states updated in place.
    See :func:`recurrent_reference.mamba1_scan`."""
    return recurrent_reference.mamba1_scan(x, dt, A, B, C, D, state, query_start_loc, chunk_size)


def mamba1_scan_step(x, dt, A, B, C, D, state):
    """Mamba 1's state update, one token per sequence (decode), states updated in place.
    See :func:`recurrent_reference.mamba1_scan_step`."""
    return recurrent_reference.mamba1_scan_step(x, dt, A, B, C, D, state)


def rms_norm_gated(x, gate, weight, eps, norm_before_gate=True, group_size=None):
    """Gated (grouped) RMSNorm of x [n, d].  See :func:`recurrent_reference.rms_norm_gated`."""
    return recurrent_reference.rms_norm_gated(x, gate, weight, eps, norm_before_gate, group_size)


#: Names of every op in the registry, in the order `pagedserve platforms --ops` shows them.
OP_NAMES: tuple[str, ...] = (
    "paged_attention",
    "mla_paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rotary_embedding",
    "rotary_paged_attention",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "quick_gelu",
    "encoder_attention",
    "fused_moe",
    "prepare_moe_weights",
    "linear",
    "prepare_linear_weight",
    "linear_silu_and_mul",
    "embedding",
    "argmax",
    "apply_token_bitmask",
    "copy_blocks",
    "swap_blocks",
    "gguf_linear",
    "prepare_gguf_weight",
    "gguf_linear_silu_and_mul",
    "gguf_linear_stacked",
    "gguf_embedding",
    "int8_linear",
    "w8a8_linear",
    "fp8_linear",
    "rejection_sample",
    "lora_linear",
    *recurrent_reference.RECURRENT_OP_NAMES,
)
