"""Building blocks a model family composes, all written against the op registry.

Weights live in plain per-layer holders (``__slots__`` classes whose tensor attributes
weight offload streams and ``prepare_linear_weights`` packs); the functions here take
the op registry of the placement that runs the layer, so the same code serves every
platform and every device-map segment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.config_rules import NO_KV_CACHE, RECURRENT_STATE
from pagedserve.models.rope import mrope_cos_sin, rope_cos_sin_cache
from pagedserve.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = [
    "LayerPlacement",
    "ScaledKVCache",
    "AttentionShape",
    "RotaryEmbedding",
    "fuse",
    "linear",
    "residual_linear",
    "add_rms_norm",
    "qkv_split",
    "paged_attention",
    "rope_paged_attention",
    "gated_mlp",
    "GATED_ACTIVATIONS",
    "head_rms_norm",
    "layer_windows",
    "engine_layer_count",
    "FALCON_H1",
    "block_types",
    "route_topk",
]

Weight = torch.Tensor | QuantizedWeight

#: ``layer_types`` entries of layers with a recurrent state instead of attention
#: (Qwen3.5 / Qwen3-Next Gated DeltaNet, Granite 4's Mamba 2).
_STATE_LAYER_TYPES = ("linear_attention", "mamba", "conv")


@dataclass(frozen=True)
class LayerPlacement:
    """Decoder layers ``[start, end)`` (model-wide indices) run with the op registry
    ``ops`` on ``device``; ``move`` brings a tensor from another placement's device to
    ``device`` (the platform's ``to_device``).  A device map gives one per segment."""

    start: int
    end: int
    ops: Any
    device: torch.device
    move: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention shape: heads after tensor-parallel sharding."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class RotaryEmbedding:
    """The cos/sin table (float32 ``[max_position, rotary_dim]``) on each placement's device.

    ``rotary_dim`` below ``head_dim`` rotates only the leading dims (partial rotary).
    """

    def __init__(
        self, rotary_dim: int, max_position: int, base: float, scaling: dict | None, devices: list[torch.device]
    ) -> None:
        self.rotary_dim = rotary_dim
        table = rope_cos_sin_cache(rotary_dim, max_position, base, scaling)
        self.tables = [table.to(d) for d in devices]

    def __call__(
        self, ops, placement: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim] -> rotated (q, k)."""
        return ops.rotary_embedding(positions, q, k, self.tables[placement])

    def plain_table(self, placement: int, positions: torch.Tensor) -> torch.Tensor | None:
        """The cos/sin table this rotation hands ``ops.rotary_embedding`` with
        ``positions`` themselves, or None where it is not that op over them."""
        return self.tables[placement]


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen-VL's multimodal RoPE: positions [3, n] (temporal, height, width; image
    tokens differ in each, text tokens have three equal ones) rotate each part of the
    frequencies (``section``; interleaved across them for Qwen3-VL) by its own
    position; 1-D positions [n] are plain RoPE (what M-RoPE is when the three are equal)."""

    def __init__(
        self, rotary_dim, max_position, base, scaling, devices, section: list[int], interleaved: bool = False
    ) -> None:
        super().__init__(rotary_dim, max_position, base, scaling, devices)
        self.section = list(section)
        self.interleaved = interleaved

    def plain_table(self, placement: int, positions: torch.Tensor) -> torch.Tensor | None:
        return self.tables[placement] if positions.dim() == 1 else None

    def __call__(self, ops, placement, positions, q, k):
        if positions.dim() == 1:
            return super().__call__(ops, placement, positions, q, k)
        rows = mrope_cos_sin(self.tables[placement], positions, self.section, self.interleaved)
        index = torch.arange(rows.shape[0], dtype=torch.int64, device=rows.device)
        return ops.rotary_embedding(index, q, k, rows)


def fuse(parts: list[Weight]) -> Weight:
    """Stack weights along the output dimension, quantized ones in their own format.

    Quantized parts are fused by their format's ``concat`` (which keeps parts of different
    block types apart).  Parts that mix quantized and float weights (a GGUF file whose v
    projection is F16 beside quantized q and k, or stored in a type without a kept
    kernel) are fused as floats: the quantized ones are dequantized to the float parts'
    dtype, with a log line."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quantized) == len(parts):
        return type(parts[0]).concat(parts)
    if not quantized:
        return torch.cat(parts)
    dense = next(p for p in parts if isinstance(p, torch.Tensor))
    kinds = sorted({str(getattr(p, "type_name", type(p).__name__)) for p in quantized})
    logger.info("a fused projection mixes %s with float parts: dequantized to %s", ", ".join(kinds), dense.dtype)
    return torch.cat(
        [p.dequantize(dense.dtype).to(dense.device) if isinstance(p, QuantizedWeight) else p for p in parts]
    )


def linear(ops, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear``, or the weight's own ``apply`` (a quantized weight's kernel, or a
    weight wrapped with LoRA adapters).  x [n, in] -> [n, out]."""
    if not isinstance(w, torch.Tensor):
        return w.apply(x, bias)
    return ops.linear(x, w, bias)


def residual_linear(
    ops, x: torch.Tensor, w: Weight, out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A projection whose output joins the residual stream (o, down): :func:`linear`, but
    with a float32 stream (``out_dtype``, the model's ``stream_dtype``) a weight that sums
    in float32 (``float32_accumulation``: GGUF blocks) returns those sums unrounded; other
    weights return x's dtype, which the norm op adds to the stream in float32."""
    if out_dtype is not None and isinstance(w, QuantizedWeight) and w.float32_accumulation:
        return w.apply(x, bias, out_dtype)  # type: ignore[call-arg]
    return linear(ops, x, w, bias)


def add_rms_norm(
    ops,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    stream_dtype: torch.dtype | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual stream: (norm(x + residual), x + residual), [n, hidden] each;
    ``residual`` None (before the first layer) means x is the stream itself.

    ``stream_dtype`` (float32; None: the stream is in x's dtype) keeps the stream in it
    beside activations of ``dtype`` (the model's): x may then be of either, the sum is
    float32 and the normalised row comes back in ``dtype`` (reference.fused_add_rms_norm)."""
    if stream_dtype is None:
        if residual is None:
            return ops.rms_norm(x, weight, eps), x
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    if residual is None:
        h = ops.rms_norm(x, weight, eps)
        return (h if h.dtype == dtype else h.to(dtype)), x.to(stream_dtype)
    return ops.fused_add_rms_norm(x, residual, weight, eps, out_dtype=dtype)


def qkv_split(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection [n, q_size + 2 * kv_size] -> q [n, heads, d], k and v [n, kv_heads, d]."""
    # One view and one split (the same strided views as splitting the columns and viewing
    # each part): a third of the Python cost, once per layer.
    h, kv = shape.num_heads, shape.num_kv_heads
    heads = qkv.view(qkv.shape[0], h + 2 * kv, shape.head_dim)
    return torch.split_with_sizes(heads, [h, kv, kv], 1)


def paged_attention(
    ops,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k/v into the paged cache, then attend: q [n, heads, d] -> [n, heads * d].

    ``sliding_window`` (keys within that many positions, the query's own included) and
    ``soft_cap`` (``cap * tanh(score / cap)``) and ``sinks`` (float32 [heads], GPT-OSS's
    per-head sink logits) and ``meta.key_ends`` (query tokens seeing keys past their own
    position: Gemma 3's image spans) are passed only when set, so a platform
    whose attention op lacks them still serves every model that does not use them.
    """
    k_cache, v_cache = kv_cache
    k_scale = v_scale = 1.0
    if isinstance(kv_cache, ScaledKVCache):
        # One scale per layer (a tensor-scaled fp8 cache): the cache holds k / k_scale and
        # v / v_scale, so q.k = k_scale * (q.k_stored) and the output is v_scale times the
        # attention over the stored values; the kernels stay those of an unscaled cache.
        k_scale, v_scale = kv_cache.k_scale, kv_cache.v_scale
        if k_scale != 1.0:
            k = k.float() / k_scale
        if v_scale != 1.0:
            v = v.float() / v_scale
    ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    if sliding_window is None and soft_cap is None and sinks is None and meta.key_ends is None:
        # Most layers of most models: no keyword arguments to collect (once per layer and step).
        out = ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale * k_scale
        )
        if v_scale != 1.0:
            out = out * v_scale
        return out.view(q.shape[0], -1)
    extra: dict[str, Any] = {}
    if sliding_window is not None:
        extra["sliding_window"] = sliding_window
    if soft_cap is not None:
        extra["soft_cap"] = soft_cap
    if sinks is not None:
        extra["sinks"] = sinks
    if meta.key_ends is not None:
        extra["key_ends"] = meta.key_ends
    out = ops.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale * k_scale, **extra
    )
    if v_scale != 1.0:
        out = out * v_scale
    return out.view(q.shape[0], -1)


def rope_paged_attention(
    ops,
    rope: RotaryEmbedding | None,
    placement: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``rope`` on q and k (None: no rotation), then :func:`paged_attention`: q [n, heads,
    d] -> [n, heads * d].  Where nothing else joins the three ops (the rotation is plain
    RoPE over ``meta.positions``, no window and no key ends, a cache without per-layer
    scales) this is one op, ``ops.rotary_paged_attention``: on the CPU one native call
    per layer of a decode step instead of three, each with its Python wrapper, argument
    conversion and checks (docs/kernels_cpu.md, "Fused decode attention call")."""
    plain = sliding_window is None and meta.key_ends is None and not isinstance(kv_cache, ScaledKVCache)
    if rope is not None and plain:
        table = rope.plain_table(placement, meta.positions)
        if table is not None:
            out = ops.rotary_paged_attention(
                meta.positions, q, k, v, table, kv_cache[0], kv_cache[1], meta.slot_mapping,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            )  # fmt: skip
            return out.view(q.shape[0], -1)
    if rope is not None:
        q, k = rope(ops, placement, meta.positions, q, k)
    return paged_attention(ops, q, k, v, kv_cache, meta, scale, sliding_window)


class ScaledKVCache(tuple):
    """One layer's (key_cache, value_cache) with the per-layer scales of a tensor-scaled
    fp8 cache: the cache stores ``k / k_scale`` and ``v / v_scale`` (vLLM's fp8 KV
    cache with a checkpoint's ``k_scale``/``v_scale``)."""

    k_scale: float
    v_scale: float

    def __new__(cls, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float, v_scale: float):
        self = super().__new__(cls, (key_cache, value_cache))
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        return self


#: transformers' ``hidden_act`` names of the gated MLPs implemented here.
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


def gated_mlp(
    ops,
    x: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    activation: str = "silu",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gated MLP: down(act(gate(x)) * up(x)); gate_up [2 * inter, hidden] fused; act SiLU
    or GELU (GeGLU; "gelu_pytorch_tanh" is its tanh approximation).
    x [n, hidden] -> [n, hidden] (before any tensor-parallel all-reduce); ``out_dtype``:
    the down projection's into a float32 residual stream (:func:`residual_linear`)."""
    if activation == "silu":
        if isinstance(gate_up, QuantizedWeight):  # its format may fuse the two (GGUF)
            h = gate_up.apply_silu_and_mul(x, ops.silu_and_mul)
        elif not isinstance(gate_up, torch.Tensor):  # with LoRA
            h = ops.silu_and_mul(gate_up.apply(x, None))
        else:
            h = ops.linear_silu_and_mul(x, gate_up)
    elif activation in GATED_ACTIVATIONS:
        h = ops.gelu_and_mul(linear(ops, x, gate_up), "tanh" if activation == "gelu_pytorch_tanh" else "none")
    else:
        raise ValueError(f"activation {activation!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    return residual_linear(ops, h, down, out_dtype)


def head_rms_norm(ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head: x [n, heads, head_dim], weight [head_dim] (Qwen3's q/k norm)."""
    n, heads, d = x.shape
    return ops.rms_norm(x.reshape(n * heads, d), weight, eps).view(n, heads, d)


def layer_windows(hf: dict[str, Any], num_layers: int) -> list[int | str | None]:
    """Each layer's sliding window (None: full attention), as transformers reads it:
    none when ``use_sliding_window`` is false; else ``layer_types`` when the config has
    it, else Qwen2-style ``max_window_layers``, else Mistral-style ``sliding_window`` on
    every layer.  A window
    no shorter than ``max_position_embeddings`` is no window.  A layer with a recurrent
    state instead of attention (``layer_types`` ``linear_attention``, ``mamba`` or LFM2's ``conv``) has the
    window ``RECURRENT_STATE`` (its KV cache group holds state pages: kv_cache/state_group.py).
    A layer that reads another layer's keys and values (the last ``num_kv_shared_layers``
    of Gemma 4) keeps none: ``NO_KV_CACHE``."""
    if hf.get("model_type") == FALCON_H1:
        # Attention and Mamba 2 side by side in each layer: two engine layers each.
        if num_layers != engine_layer_count(hf):
            raise ValueError(f"Falcon-H1 runs {engine_layer_count(hf)} engine layers, not {num_layers}")
        return [None, RECURRENT_STATE] * (num_layers // 2)
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") is False:
        window = None  # Qwen2/Qwen3/SmolLM3 keep a window size they do not use
    blocks = block_types(hf)
    if blocks is not None:
        # Nemotron-H: one mixer per layer; its MLP layers keep nothing per request.
        if len(blocks) != num_layers:
            raise ValueError(f"layers_block_type has {len(blocks)} entries for {num_layers} layers")
        kinds = {"full_attention": None, "linear_attention": RECURRENT_STATE}
        return [kinds.get(b, NO_KV_CACHE) for b in blocks]
    types = hf.get("layer_types")
    if types is None and "attn_layer_period" in hf:  # Jamba: attention every period-th layer
        period, offset = int(hf["attn_layer_period"]), int(hf.get("attn_layer_offset", 4))
        types = ["full_attention" if i % period == offset else "mamba" for i in range(num_layers)]
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        known = {"full_attention", "sliding_attention", *_STATE_LAYER_TYPES, "attention"}
        unknown = sorted(set(types) - known)
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (supported: {', '.join(sorted(known))})")
        out = [
            RECURRENT_STATE if t in _STATE_LAYER_TYPES else window if t == "sliding_attention" else None for t in types
        ]
    elif "use_sliding_window" in hf:
        first = hf.get("max_window_layers", num_layers)
        out = [window if i >= first else None for i in range(num_layers)]
    else:
        out = [window] * num_layers
    if any(isinstance(w, int) and w < 1 for w in out):
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    limit = hf.get("max_position_embeddings")
    out = [
        w if w is None or w == RECURRENT_STATE else None if limit is not None and w >= limit else int(w) for w in out
    ]
    # Gemma 4's last num_kv_shared_layers layers read an earlier layer's keys and values.
    shared = int(hf.get("num_kv_shared_layers") or 0)
    if 0 < shared < num_layers:
        out[num_layers - shared :] = [NO_KV_CACHE] * shared
    return out


#: ``model_type`` of Falcon-H1, whose every layer runs attention and Mamba 2 side by side.
FALCON_H1 = "falcon_h1"


def engine_layer_count(hf: dict[str, Any]) -> int:
    """Layers the engine runs, caches and groups for config.json ``hf``: its
    ``num_hidden_layers``, except Falcon-H1's, which are two each (``2 * i``: the layer's
    attention; ``2 * i + 1``: its Mamba 2 mixer and MLP; models/falcon_h1.py), so that
    the attention half has a KV cache group of token blocks and the Mamba half one of
    state pages (kv_cache/kv_groups.py), with no other change to the engine."""
    n = int(hf["num_hidden_layers"])
    return 2 * n if hf.get("model_type") == FALCON_H1 else n


#: Nemotron-H's ``hybrid_override_pattern`` letters -> ``layers_block_type`` names.
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def block_types(hf: dict[str, Any]) -> list[str] | None:
    """Each layer's mixer of a one-mixer-per-layer config (Nemotron-H: ``layers_block_type``,
    or ``hybrid_override_pattern`` such as ``"M-M*-"``), None for other configs."""
    blocks = hf.get("layers_block_type")
    if blocks is None and isinstance(hf.get("hybrid_override_pattern"), str):
        pattern = hf["hybrid_override_pattern"]
        unknown = sorted(set(pattern) - _PATTERN.keys())
        if unknown:
            raise ValueError(f"hybrid_override_pattern letters {unknown} are not supported (M, *, -, E)")
        blocks = [_PATTERN[c] for c in pattern]
    if blocks is None:
        return None
    names = {"mamba": "linear_attention", "attention": "full_attention"}
    return [names.get(b, b) for b in blocks]


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: router_logits [T, E] -> (weights float32 [T, top_k], ids int64
    [T, top_k]) of each token's top_k experts; ``renormalize`` makes each row sum to 1
    (Mixtral, ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
