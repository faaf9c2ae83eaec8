"""GLM-4 (``Glm4ForCausalLM``): sandwich-normed decoder layers (a norm after attention
and after the MLP too), q/k/v biases, a checkpoint-fused ``gate_up_proj``, and
partial rotary in GLM's interleaved form (pairs of adjacent dims).

The interleaved rotation is turned into pagedserve's rotate-half one at load: the rows
of each head's rotary part of q_proj and k_proj (and their biases) are reordered evens
first, odds second.  Queries and keys move together, so attention scores are unchanged.
Quantized projections keep their stored row order (a quantized format need not allow
moving rows) and the fused q/k/v output columns are reordered at run time instead.
Under tensor parallelism the checkpoint-fused gate_up is split per rank at load (this
rank's gate rows and up rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import (
    add_rms_norm,
    fuse,
    gated_mlp,
    layer_windows,
    linear,
    qkv_split,
    rope_paged_attention,
)
from pagedserve.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Glm4ForCausalLM", "Glm4Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class Glm4Layer:
    __slots__ = (
        "input_norm",
        "post_attn_norm",
        "pre_ff_norm",
        "post_ff_norm",
        "qkv",
        "qkv_bias",
        "qkv_order",
        "o",
        "gate_up",
        "down",
    )


class Glm4ForCausalLM(DecoderForCausalLM):
    layer_class = Glm4Layer
    linear_fields = ("qkv", "o", "gate_up", "down")
    default_attention_bias = True

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        if any(layer_windows(cfg.hf_config, cfg.num_layers)):
            raise ValueError("Glm4ForCausalLM: sliding windows are not supported")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "input_layernorm.weight",
            "post_self_attn_layernorm.weight",
            "post_attention_layernorm.weight",
            "post_mlp_layernorm.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_up_proj.weight",
            "mlp.down_proj.weight",
        }
        names |= {f"self_attn.{p}.weight" for p in _ATTN}
        if self.cfg.attention_bias:
            names |= {f"self_attn.{p}.bias" for p in _ATTN}
        return frozenset(names)

    def _rotate_half_order(self, rows: int) -> torch.Tensor:
        """int64 [rows]: for rows of whole heads of q_proj / k_proj, each head's first
        rotary_dim rows reordered evens then odds."""
        d, rot = self.cfg.head_dim, self.rope.rotary_dim
        order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])
        return (torch.arange(0, rows, d)[:, None] + order).reshape(-1)

    def finish_layer(self, layer: Glm4Layer, w: dict[str, Any], param) -> None:
        a = "self_attn."
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_attn_norm = param(w["post_self_attn_layernorm.weight"])
        layer.pre_ff_norm = param(w["post_attention_layernorm.weight"])
        layer.post_ff_norm = param(w["post_mlp_layernorm.weight"])
        q, k, v = (w[a + p + ".weight"] for p in _ATTN)
        q_order, k_order = self._rotate_half_order(self.q_size), self._rotate_half_order(self.kv_size)
        # Weights and biases move together: both in rotate-half order, or both stored.
        stored = isinstance(q, QuantizedWeight)
        layer.qkv_order = None
        if stored:
            v_order = torch.arange(self.kv_size) + self.q_size + self.kv_size
            order = torch.cat([q_order, k_order + self.q_size, v_order])
            layer.qkv_order = order.to(layer.input_norm.device)
        else:
            q, k = q[q_order], k[k_order]
        layer.qkv = param(fuse([q, k, v]))
        layer.qkv_bias = None
        if self.cfg.attention_bias:
            qb, kb, vb = (w[a + p + ".bias"] for p in _ATTN)
            if not stored:
                qb, kb = qb[q_order], kb[k_order]
            layer.qkv_bias = param(torch.cat([qb, kb, vb]))
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(w["mlp.gate_up_proj.weight"])  # rows: gate, up
        layer.down = param(w["mlp.down_proj.weight"])

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Glm4Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        qkv = linear(ops, h, layer.qkv, layer.qkv_bias)
        if layer.qkv_order is not None:
            qkv = qkv.index_select(-1, layer.qkv_order)
        q, k, v = qkv_split(qkv, self.attn)
        attn = rope_paged_attention(ops, self.rope, placement, q, k, v, kv_cache, meta, self.attn.scale)
        h = linear(ops, attn, layer.o)
        h = self.parallel.all_reduce(h)
        h, residual = ops.fused_add_rms_norm(
            ops.rms_norm(h, layer.post_attn_norm, eps), residual, layer.pre_ff_norm, eps
        )
        h = self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down))
        return ops.rms_norm(h, layer.post_ff_norm, eps), residual
