"""OLMo 2: post-norm decoder layers (a norm on each sublayer's output, none on its
input) and q/k RMSNorm over the whole projection (all heads at once), composed from
:mod:`pagedserve.models.layers`.  The whole-projection norm needs every head, so the
family does not shard over tensor-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import fuse, gated_mlp, layer_windows, linear, paged_attention, qkv_split

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Olmo2ForCausalLM", "Olmo2Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class Olmo2Layer:
    """One layer: post-attention and post-feed-forward norms [hidden]; q_norm [heads *
    head_dim] and k_norm [kv_heads * head_dim] over the whole projections."""

    __slots__ = ("post_attn_norm", "post_ff_norm", "qkv", "q_norm", "k_norm", "o", "gate_up", "down")


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_class = Olmo2Layer
    linear_fields = ("qkv", "o", "gate_up", "down")
    tensor_parallel = False

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        if cfg.attention_bias:
            raise ValueError("Olmo2ForCausalLM: attention_bias=true is not supported")
        if any(layer_windows(cfg.hf_config, cfg.num_layers)):
            raise ValueError("Olmo2ForCausalLM: sliding windows are not supported")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "post_attention_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        return frozenset(names | {f"self_attn.{p}.weight" for p in _ATTN})

    def finish_layer(self, layer: Olmo2Layer, w: dict[str, Any], param) -> None:
        a = "self_attn."
        layer.post_attn_norm = param(w["post_attention_layernorm.weight"])
        layer.post_ff_norm = param(w["post_feedforward_layernorm.weight"])
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.q_norm = param(w[a + "q_norm.weight"])
        layer.k_norm = param(w[a + "k_norm.weight"])
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Olmo2Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        stream = x if residual is None else x + residual  # no input norm: attention reads the stream
        qkv = linear(ops, stream, layer.qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)
        q, k, v = qkv_split(torch.cat([q, k, v], dim=-1), self.attn)
        q, k = self.rope(ops, placement, meta.positions, q, k)
        h = linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o)
        stream = stream + ops.rms_norm(h, layer.post_attn_norm, eps)
        h = gated_mlp(ops, stream, layer.gate_up, layer.down)
        return ops.rms_norm(h, layer.post_ff_norm, eps), stream
