"""Pure-torch reference of every pagedserve kernel: this file is the specification.

Every other implementation (Triton, CUDA C++, the native CPU kernels, a plugin's
override) is tested against these functions on fresh random inputs.  They favour
clarity over speed, but avoid per-token Python loops so that they stay usable as the
fallback on platforms without a native kernel.

Layout of one layer's KV cache (the reference layout):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
A slot is ``block_id * block_size + offset``; slot ``-1`` means "do not write".
The cache's dtype is the model's, or an 8-bit float (a quantized KV cache,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``): keys and values are written as
:func:`quantize_kv` casts them (scale 1.0) and attention reads them as float32.

The quantized linear ops (``gguf_linear``, ``int8_linear``, ``w8a8_linear``,
``fp8_linear``) take a weight in its stored format; the formats and the computation are
specified in :mod:`pagedserve.kernels.quant_reference`, which these ops call.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import lora_reference, quant_reference, spec_reference

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "quantize_kv",
    "QUANTIZED_KV_TORCH_DTYPES",
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
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
    "gguf_embedding",
    "int8_linear",
    "w8a8_linear",
    "fp8_linear",
    "rejection_sample",
    "lora_linear",
    "OP_NAMES",
]


#: The 8-bit float KV cache dtypes (a platform declares the ones it reads).
QUANTIZED_KV_TORCH_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    An 8-bit float cache stores :func:`quantize_kv` of the keys and values.
    """
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # (block, offset) indexing rather than a flat view: a platform may hand in caches
    # whose storage is not token-major (the CPU platform's are head-major views).
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
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
) -> torch.Tensor:
    """Varlen causal attention over the paged KV cache for a mixed batch.

    query: [num_tokens, num_heads, head_size]; the tokens of sequence i are
        query[query_start_loc[i]:query_start_loc[i+1]] and are the *last* q_len_i
        positions of that sequence (prefill chunk, prefix-cache continuation or decode).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
        (already holding the keys/values of the new tokens), in query's dtype or an
        8-bit float (a quantized cache: its values are read exactly, as float32).
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
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        # Blocks wholly before the first key any query of this sequence sees may have
        # been freed (their table entries point at a null block of arbitrary content,
        # NaN included), so they are never gathered.
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, ctx - q_len - sliding_window + 1) // block_size
        k_start = first_block * block_size
        blocks = block_tables[i, first_block:n_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[: ctx - k_start].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[: ctx - k_start].float()
        q = query[q_start:q_end].float()
        # [kv_heads, group, q_len, d] x [kv_heads, d, ctx - k_start]
        qh = q.view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(qh, k.permute(1, 2, 0).unsqueeze(1)) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(q_len, 1)
        k_pos = torch.arange(k_start, ctx, device=query.device).view(1, ctx - k_start)
        masked = k_pos > q_pos
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, returned in x's dtype."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual).

    Implementations may update ``x`` and ``residual`` in place; callers must not
    reuse them afterwards except through the returned tensors.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


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


def gguf_linear(x: torch.Tensor, data: torch.Tensor, type_name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for W kept in GGUF blocks.

    x: [M, K] float32/bfloat16/float16; data: uint8 [N, K/32 * block_bytes], the ggml
    blocks of type_name ("Q4_0", "Q4_1" or "Q8_0") as the .gguf file stores them;
    bias: [N] or None.  Returns [M, N] in x.dtype, computed in float32.  An
    implementation may quantize x to int8 per 32-value block (as llama.cpp does); the
    conformance kit allows for that error.
    """
    return quant_reference.gguf_linear(x, data, type_name, bias)


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


#: Names of every op in the registry, in the order `pagedserve platforms --ops` shows them.
OP_NAMES: tuple[str, ...] = (
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
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
    "gguf_embedding",
    "int8_linear",
    "w8a8_linear",
    "fp8_linear",
    "rejection_sample",
    "lora_linear",
)
