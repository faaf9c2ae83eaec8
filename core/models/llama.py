"""The Llama family (Llama 2/3, Mistral, SmolLM2) and Qwen2: pre-norm decoder layers
of RoPE attention and a SiLU-gated MLP, composed from :mod:`pagedserve.models.layers`.

Weights are fused at load: q/k/v into one [q+2kv, hidden] matrix (plus bias for
Qwen2), gate/up into one [2*intermediate, hidden] matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import (
    LayerPlacement,
    add_rms_norm,
    fuse,
    gated_mlp,
    linear,
    paged_attention,
    qkv_split,
)

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["ArchConfig", "LlamaForCausalLM", "Qwen2ForCausalLM", "LlamaLayer", "LayerPlacement"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class LlamaLayer:
    """One decoder layer's weights (dense tensors or quantized weights)."""

    __slots__ = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")


class LlamaForCausalLM(DecoderForCausalLM):
    """Inference-only Llama/Mistral/Qwen2 (see :class:`DecoderForCausalLM` for sharding
    and placements)."""

    layer_class = LlamaLayer
    linear_fields = ("qkv", "o", "gate_up", "down")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        hf = cfg.hf_config
        window = hf.get("sliding_window")
        if cfg.architecture == "MistralForCausalLM" and window not in (None, 0) and \
                window < cfg.max_position_embeddings:
            raise ValueError("Mistral checkpoints with a sliding window are not supported")
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
        names |= {f"self_attn.{p}.weight" for p in _ATTN}
        if self.cfg.attention_bias:
            names |= {f"self_attn.{p}.bias" for p in _ATTN}
        return frozenset(names)

    def finish_layer(self, layer: LlamaLayer, w: dict[str, Any], param) -> None:
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        a = "self_attn."
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.qkv_bias = param(torch.cat([w[a + p + ".bias"] for p in _ATTN])) if self.cfg.attention_bias else None
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def layer_forward(self, ops, placement: int, index: int, layer: LlamaLayer, kv_cache: KVCache,
                      x: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
        q, k = self.rope(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale)
        x = self.parallel.all_reduce(linear(ops, attn, layer.o))
        h, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, eps)
        return self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down)), residual


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases by default."""

    default_attention_bias = True


def __getattr__(name: str) -> Any:
    # AttentionMetadata moved beside the executor that builds it; old imports keep working.
    if name == "AttentionMetadata":
        from pagedserve.executor.attention_metadata import AttentionMetadata

        return AttentionMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
