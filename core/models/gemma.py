"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text), composed from
:mod:`pagedserve.models.layers`.

What sets them apart from Llama: RMSNorm weights applied as ``1 + w`` (folded into the
weight at load), a GeGLU MLP, embeddings scaled by ``sqrt(hidden_size)``, attention
scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 adds sandwich norms (a norm after
attention and after the MLP too), attention and final-logit soft-capping and
alternating sliding-window layers; Gemma 3 replaces the attention soft-cap by per-head
q/k norms and gives its sliding-window layers their own RoPE base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import (
    GATED_ACTIVATIONS,
    RotaryEmbedding,
    add_rms_norm,
    fuse,
    gated_mlp,
    head_rms_norm,
    layer_windows,
    linear,
    paged_attention,
    qkv_split,
    residual_linear,
)
from pagedserve.models.rope import check_rope_scaling, normalize_rope_scaling

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaLayer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class GemmaLayer:
    """One decoder layer's weights; norms already hold ``1 + w``.  The sandwich norms
    (post_attn_norm, post_ff_norm) and q_norm/k_norm are None where the version has none."""

    __slots__ = (
        "input_norm",
        "post_attn_norm",
        "pre_ff_norm",
        "post_ff_norm",
        "qkv",
        "q_norm",
        "k_norm",
        "o",
        "gate_up",
        "down",
    )


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma (v1): Llama's layer layout with Gemma's norms, GeGLU and scaled embeddings."""

    layer_class = GemmaLayer
    linear_fields = ("qkv", "o", "gate_up", "down")
    float32_residual = True
    sandwich_norms: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"{cfg.architecture}: hidden_activation {act!r} is not supported")
        if cfg.attention_bias:
            raise ValueError(f"{cfg.architecture}: attention_bias=true is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture}: use_bidirectional_attention=true is not supported")
        layer_windows(hf, cfg.num_layers)

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        self.windows = layer_windows(hf, cfg.num_layers)
        self.attn_soft_cap: float | None = hf.get("attn_logit_softcapping")
        self.final_soft_cap: float | None = hf.get("final_logit_softcapping")
        # transformers rounds the scale to the model dtype before multiplying.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype)

    def attention_scale(self) -> float:
        return float(self.cfg.hf_config.get("query_pre_attn_scalar") or self.cfg.head_dim) ** -0.5

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        names |= {f"self_attn.{p}.weight" for p in _ATTN}
        if self.sandwich_norms:
            names |= {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
        if self.qk_norm:
            names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        return frozenset(names)

    def finish_layer(self, layer: GemmaLayer, w: dict[str, Any], param) -> None:
        def norm(name: str) -> torch.Tensor:
            return param(w[name].float() + 1.0)  # Gemma's RMSNorm multiplies by (1 + w)

        layer.input_norm = norm("input_layernorm.weight")
        if self.sandwich_norms:
            layer.post_attn_norm = norm("post_attention_layernorm.weight")
            layer.pre_ff_norm = norm("pre_feedforward_layernorm.weight")
            layer.post_ff_norm = norm("post_feedforward_layernorm.weight")
        else:  # Gemma v1: post_attention_layernorm is the norm before the MLP
            layer.post_attn_norm, layer.post_ff_norm = None, None
            layer.pre_ff_norm = norm("post_attention_layernorm.weight")
        a = "self_attn."
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.q_norm = norm(a + "q_norm.weight") if self.qk_norm else None
        layer.k_norm = norm(a + "k_norm.weight") if self.qk_norm else None
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        # The final norm is (1 + w) too; the embedding itself stays unscaled (tied LM head).
        self.norm = self.norm.float().add(1.0).to(self.norm.dtype)

    def rope_for(self, index: int) -> RotaryEmbedding:
        return self.rope

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: GemmaLayer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps, stream = self.cfg.rms_norm_eps, self.stream_dtype
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps, stream, self.dtype)
        q, k, v = qkv_split(linear(ops, h, layer.qkv), self.attn)
        if layer.q_norm is not None:
            q, k = head_rms_norm(ops, q, layer.q_norm, eps), head_rms_norm(ops, k, layer.k_norm, eps)
        q, k = self.rope_for(index)(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale, self.windows[index], self.attn_soft_cap)
        # With a float32 stream the o / down sums stay float32 through the sandwich norms.
        h = self.parallel.all_reduce(residual_linear(ops, attn, layer.o, stream))
        if layer.post_attn_norm is not None:
            h = ops.rms_norm(h, layer.post_attn_norm, eps)
        h, residual = add_rms_norm(ops, h, residual, layer.pre_ff_norm, eps, stream, self.dtype)
        h = self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down, self.activation, stream))
        if layer.post_ff_norm is not None:
            h = ops.rms_norm(h, layer.post_ff_norm, eps)
        return h, residual

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_tokens(input_ids)
        return x * self.embed_scale.to(x.device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, float32)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: sandwich norms, soft-capping, alternating sliding-window layers."""

    sandwich_norms = True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2 with per-head q/k norms and a separate RoPE (base, and
    scaling only on global layers) for the sliding-window layers."""

    qk_norm = True

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        for _, scaling in _gemma3_rope(cfg):
            check_rope_scaling(scaling)

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding:
        cfg = self.cfg
        (global_theta, global_scaling), (local_theta, local_scaling) = _gemma3_rope(cfg)
        pos = self.max_positions
        self.local_rope = RotaryEmbedding(cfg.head_dim, pos, local_theta, local_scaling, devices)
        return RotaryEmbedding(cfg.head_dim, pos, global_theta, global_scaling, devices)

    def rope_for(self, index: int) -> RotaryEmbedding:
        return self.rope if self.windows[index] is None else self.local_rope


def _gemma3_rope(cfg: ArchConfig) -> list[tuple[float, dict | None]]:
    """[(theta, scaling) of full-attention layers, (theta, scaling) of sliding ones],
    from transformers 5's per-layer-type ``rope_parameters`` or the older flat keys."""
    hf = cfg.hf_config
    params = hf.get("rope_parameters")
    out = []
    for kind, flat_theta, default_theta in (
        ("full_attention", "rope_theta", 1_000_000.0),
        ("sliding_attention", "rope_local_base_freq", 10_000.0),
    ):
        if isinstance(params, dict) and isinstance(params.get(kind), dict):
            p = params[kind]
            theta = float(p.get("rope_theta", default_theta))
            scaling = p if p.get("rope_type", "default") != "default" else None
        else:
            theta = float(hf.get(flat_theta) or default_theta)
            scaling = hf.get("rope_scaling") if kind == "full_attention" else None
        out.append((theta, normalize_rope_scaling(scaling, hf)[0]))
    return out
