"""Gemma 4 (text, ``Gemma4ForCausalLM``), as transformers implements it, for the configs
without its per-layer embeddings, KV sharing and MoE block (refused by name).

What differs from Gemma 3: RMSNorm weights multiply as ``w`` (not ``1 + w``); values
get an RMSNorm without weight, queries and keys a per-head one, and the attention scale
is 1; full-attention layers have their own head size (``per_layer_config`` /
``global_head_dim``, 512 against 256 at the published sizes) and may have their own KV
head count (``num_global_key_value_heads`` with ``attention_k_eq_v``, which also makes
those layers' values the key projection's output, before the key norm and RoPE); the
full layers' RoPE is "proportional" (only the first ``partial_rotary_factor`` of the
frequencies rotate, with exponents over the whole head size; the rest stay still); and
each layer's output (the whole residual stream) is multiplied by its ``layer_scalar``.
Sandwich norms, GeGLU, scaled embeddings and final-logit soft-capping are Gemma 2/3's.

The paged cache has one head size and KV head count for every layer: the largest of
each.  A layer with smaller heads zero-pads its queries, keys and values (the scores do
not change; the output is sliced back) and a layer with fewer KV heads repeats each so
that every query head still reads its own -- exact, at the cost of KV memory on the
sliding layers (half their cache is padding at the published sizes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import (
    GATED_ACTIVATIONS,
    RotaryEmbedding,
    fuse,
    gated_mlp,
    head_rms_norm,
    layer_windows,
    linear,
    paged_attention,
)

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Gemma4ForCausalLM", "Gemma4Layer", "ProportionalRotaryEmbedding"]

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """transformers' "proportional" RoPE over a whole head of ``head_dim``: frequency i is
    ``base ** (-2i / head_dim) / factor`` for the first ``int(fraction * head_dim / 2)``
    pairs and zero (no rotation) for the rest."""

    def __init__(self, head_dim: int, max_position: int, base: float, fraction: float, factor: float, devices) -> None:
        self.rotary_dim = head_dim
        rotated = int(fraction * head_dim // 2)
        inv_freq = torch.zeros(head_dim // 2)
        inv_freq[:rotated] = 1.0 / (base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = inv_freq / factor
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.tables = [table.to(d) for d in devices]


class Gemma4Layer:
    """One layer: the four sandwich norms [hidden], q/k norms [head], q/k/v or q/k
    (``attention_k_eq_v``), o, gate_up, down, and the layer scalar (a Python float)."""

    __slots__ = (
        "input_norm",
        "post_attn_norm",
        "pre_ff_norm",
        "post_ff_norm",
        "q",
        "k",
        "v",
        "q_norm",
        "k_norm",
        "o",
        "gate_up",
        "down",
        "scalar",
    )


def _layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, or transformers' default (5 sliding : 1 full); the last layer is
    always full attention, as transformers forces it."""
    types = list(
        hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    )
    if types:
        types[-1] = "full_attention"
    return types


def _layer_shapes(hf: dict[str, Any], num_layers: int) -> list[tuple[int, int]]:
    """(head_dim, kv_heads) of every layer: ``per_layer_config`` overrides (keyed by layer
    index, as transformers writes them) or ``global_head_dim`` / ``num_global_key_value_heads``
    on the full-attention layers."""
    head = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    per_layer = hf.get("per_layer_config")
    types = _layer_types(hf, num_layers)
    out = []
    for i, kind in enumerate(types):
        if isinstance(per_layer, dict):
            over = per_layer.get(str(i)) or per_layer.get(i) or {}
        elif kind == "full_attention":
            over = {"head_dim": hf.get("global_head_dim", 512)}
            if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
                over["num_key_value_heads"] = hf["num_global_key_value_heads"]
        else:
            over = {}
        out.append((int(over.get("head_dim") or head), int(over.get("num_key_value_heads") or kv)))
    return out


class Gemma4ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma4Layer
    linear_fields = ("q", "k", "v", "o", "gate_up", "down")
    tensor_parallel = False

    @classmethod
    def kv_cache_heads(cls, hf: dict[str, Any]) -> int:
        return max(kv for _, kv in _layer_shapes(hf, hf["num_hidden_layers"]))

    @classmethod
    def kv_head_dim(cls, hf: dict[str, Any]) -> int:
        return max(d for d, _ in _layer_shapes(hf, hf["num_hidden_layers"]))

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf, name = cfg.hf_config, cfg.architecture

        def refuse(what: str) -> None:
            raise ValueError(f"{name}: {what} is not supported")

        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GATED_ACTIVATIONS:
            refuse(f"hidden_activation {act!r}")
        if cfg.attention_bias:
            refuse("attention_bias=true")
        if hf.get("use_bidirectional_attention"):
            refuse(f"use_bidirectional_attention={hf['use_bidirectional_attention']!r}")
        if int(hf.get("hidden_size_per_layer_input") or 0):
            refuse("per-layer input embeddings (hidden_size_per_layer_input > 0, Gemma 4 E2B/E4B)")
        if int(hf.get("num_kv_shared_layers") or 0):
            refuse("num_kv_shared_layers > 0 (layers reusing another layer's KV)")
        if hf.get("enable_moe_block"):
            refuse("enable_moe_block=true (the MoE block)")
        heads = cfg.num_heads
        for i, (_, kv) in enumerate(_layer_shapes(hf, cfg.num_layers)):
            if heads % kv or cfg.num_kv_heads % kv:
                refuse(f"layer {i}'s {kv} KV heads with {heads} heads and {cfg.num_kv_heads} KV heads elsewhere")
        layer_windows({**hf, "layer_types": _layer_types(hf, cfg.num_layers)}, cfg.num_layers)
        for kind, params in cls._rope_params(hf).items():
            rope_type = params.get("rope_type", "default")
            if rope_type not in ("default", "proportional"):
                refuse(f"{kind} rope_type {rope_type!r} (default, proportional)")

    @staticmethod
    def _rope_params(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
        params = hf.get("rope_parameters")
        params = params if isinstance(params, dict) else {}
        return {kind: {**default, **(params.get(kind) or {})} for kind, default in _DEFAULT_ROPE.items()}

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        hf = cfg.hf_config
        self.layer_types = _layer_types(hf, cfg.num_layers)
        self.shapes = _layer_shapes(hf, cfg.num_layers)
        super().__init__(cfg, *args, **kwargs)
        self.activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        self.windows = layer_windows({**hf, "layer_types": self.layer_types}, cfg.num_layers)
        self.final_soft_cap: float | None = hf.get("final_logit_softcapping")
        self.k_eq_v = bool(hf.get("attention_k_eq_v"))
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype)

    def attention_scale(self) -> float:
        return 1.0

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding:
        """One table per layer type, each over its layers' head size."""
        params, pos = self._rope_params(self.cfg.hf_config), self.max_positions
        self.ropes: dict[str, RotaryEmbedding] = {}
        for kind in set(self.layer_types):
            p = params[kind]
            head = next(d for (d, _), t in zip(self.shapes, self.layer_types) if t == kind)
            if p.get("rope_type", "default") == "proportional":
                fraction, factor = float(p.get("partial_rotary_factor", 1.0)), float(p.get("factor", 1.0))
                rope = ProportionalRotaryEmbedding(head, pos, float(p["rope_theta"]), fraction, factor, devices)
            else:
                rope = RotaryEmbedding(head, pos, float(p["rope_theta"]), None, devices)
            self.ropes[kind] = rope
        return self.ropes[self.layer_types[-1]]

    def _uses_v(self, layer: int) -> bool:
        return not (self.k_eq_v and self.layer_types[layer] == "full_attention")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "layer_scalar",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        if self._uses_v(layer):
            names.add("self_attn.v_proj.weight")
        return frozenset(names)

    def finish_layer(self, layer: Gemma4Layer, w: dict[str, Any], param) -> None:
        a = "self_attn."
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_attn_norm = param(w["post_attention_layernorm.weight"])
        layer.pre_ff_norm = param(w["pre_feedforward_layernorm.weight"])
        layer.post_ff_norm = param(w["post_feedforward_layernorm.weight"])
        layer.scalar = float(w["layer_scalar"].float().reshape(-1)[0])
        layer.q = param(w[a + "q_proj.weight"])
        layer.k = param(w[a + "k_proj.weight"])
        layer.v = param(w[a + "v_proj.weight"]) if a + "v_proj.weight" in w else None
        layer.q_norm = param(w[a + "q_norm.weight"])
        layer.k_norm = param(w[a + "k_norm.weight"])
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def attention(
        self, ops, placement: int, index: int, layer: Gemma4Layer, h: torch.Tensor, kv_cache: KVCache, meta
    ) -> torch.Tensor:
        """h [n, hidden] normed -> [n, heads * this layer's head size]."""
        n, heads, eps = h.shape[0], self.num_heads, self.cfg.rms_norm_eps
        d, kv = self.shapes[index]
        cache_d, cache_kv = self.cfg.head_dim, self.num_kv_heads
        q = head_rms_norm(ops, linear(ops, h, layer.q).view(n, heads, d), layer.q_norm, eps)
        k_raw = linear(ops, h, layer.k).view(n, kv, d)
        v = k_raw if layer.v is None else linear(ops, h, layer.v).view(n, kv, d)
        k = head_rms_norm(ops, k_raw, layer.k_norm, eps)
        v = head_rms_norm(ops, v, torch.ones(d, dtype=v.dtype, device=v.device), eps)
        q, k = self.ropes[self.layer_types[index]](ops, placement, meta.positions, q.contiguous(), k.contiguous())
        if kv < cache_kv:  # each KV head once per cache head its query heads read
            k, v = (t.repeat_interleave(cache_kv // kv, dim=1) for t in (k, v))
        if d < cache_d:
            q, k, v = (torch.nn.functional.pad(t, (0, cache_d - d)) for t in (q, k, v))
        out = paged_attention(ops, q, k.contiguous(), v.contiguous(), kv_cache, meta, 1.0, self.windows[index])
        return out.view(n, heads, cache_d)[..., :d].reshape(n, heads * d)

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Gemma4Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        stream = x if residual is None else x + residual
        h = linear(
            ops,
            self.attention(ops, placement, index, layer, ops.rms_norm(stream, layer.input_norm, eps), kv_cache, meta),
            layer.o,
        )
        stream = stream + ops.rms_norm(h, layer.post_attn_norm, eps)
        h = gated_mlp(ops, ops.rms_norm(stream, layer.pre_ff_norm, eps), layer.gate_up, layer.down, self.activation)
        h = ops.rms_norm(h, layer.post_ff_norm, eps)
        # The scalar multiplies the whole stream: handed on as (x, residual), both scaled.
        return h * layer.scalar, stream * layer.scalar

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_tokens(input_ids)
        return x * self.embed_scale.to(x.device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, float32)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
