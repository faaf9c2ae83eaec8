"""The Llama family (Llama 2/3, Mistral, SmolLM2) and Qwen2: pre-norm decoder layers
of RoPE attention and a SiLU-gated MLP, composed from :mod:`pagedserve.models.layers`.

Weights are fused at load: q/k/v into one [q+2kv, hidden] matrix (plus bias for
Qwen2), gate/up into one [2*intermediate, hidden] matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import (
    LayerPlacement,
    add_rms_norm,
    fuse,
    gated_mlp,
    head_rms_norm,
    layer_windows,
    linear,
    qkv_split,
    residual_linear,
    rope_paged_attention,
)

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = [
    "ArchConfig",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Phi3ForCausalLM",
    "LlamaLayer",
    "LayerPlacement",
]

_ATTN = ("q_proj", "k_proj", "v_proj")


class LlamaLayer:
    """One decoder layer's weights (dense tensors or quantized weights); q_norm/k_norm
    [head_dim] only where the family normalises each head (Qwen3)."""

    __slots__ = ("input_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "gate_up", "down")


class LlamaForCausalLM(DecoderForCausalLM):
    """Inference-only Llama/Mistral/Qwen2 (see :class:`DecoderForCausalLM` for sharding
    and placements)."""

    layer_class = LlamaLayer
    linear_fields = ("qkv", "o", "gate_up", "down")
    float32_residual = True

    #: Whether each head's q and k are RMS-normalised before RoPE (Qwen3).
    qk_norm: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        layer_windows(cfg.hf_config, cfg.num_layers)

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        #: Per model-wide layer: its sliding window, or None for full attention.
        self.windows = layer_windows(hf, cfg.num_layers)
        #: Per model-wide layer: whether it applies RoPE (SmolLM3's NoPE layers do not).
        self.rope_layers = [bool(r) for r in hf.get("no_rope_layers") or [1] * cfg.num_layers]
        if len(self.rope_layers) != cfg.num_layers:
            raise ValueError(f"no_rope_layers has {len(self.rope_layers)} entries for {cfg.num_layers} layers")
        #: Scale of each sublayer's output before it joins the residual stream (Granite).
        self.residual_multiplier = float(hf.get("residual_multiplier", 1.0))

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
        if self.cfg.attention_bias:
            names |= {f"self_attn.{p}.bias" for p in _ATTN}
        if self.qk_norm:
            names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        return frozenset(names)

    def finish_layer(self, layer: LlamaLayer, w: dict[str, Any], param) -> None:
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        a = "self_attn."
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.qkv_bias = param(torch.cat([w[a + p + ".bias"] for p in _ATTN])) if self.cfg.attention_bias else None
        layer.q_norm = param(w[a + "q_norm.weight"]) if self.qk_norm else None
        layer.k_norm = param(w[a + "k_norm.weight"]) if self.qk_norm else None
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: LlamaLayer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps, stream = self.cfg.rms_norm_eps, self.stream_dtype
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps, stream, self.dtype)
        q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
        if layer.q_norm is not None:
            q, k = head_rms_norm(ops, q, layer.q_norm, eps), head_rms_norm(ops, k, layer.k_norm, eps)
        rope = self.rope if self.rope_layers[index] else None
        attn = rope_paged_attention(ops, rope, placement, q, k, v, kv_cache, meta, self.attn.scale, self.windows[index])
        x = self.parallel.all_reduce(residual_linear(ops, attn, layer.o, stream))
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        h, residual = add_rms_norm(ops, x, residual, layer.post_norm, eps, stream, self.dtype)
        x = self.parallel.all_reduce(self.mlp_forward(ops, index, layer, h))
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual

    def mlp_forward(self, ops, index: int, layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward block of model-wide layer ``index``: h [n, hidden] -> [n, hidden]
        (float32 from GGUF blocks into a float32 residual stream, else h's dtype)."""
        return gated_mlp(ops, h, layer.gate_up, layer.down, out_dtype=self.stream_dtype)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases by default."""

    default_attention_bias = True


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite: Llama with scaled embeddings, attention (``attention_multiplier`` is the
    whole softmax scale), residual branches and logits (divided by ``logits_scaling``)."""

    def attention_scale(self) -> float:
        return float(self.cfg.hf_config.get("attention_multiplier", self.cfg.head_dim**-0.5))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * float(self.cfg.hf_config.get("embedding_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return super().compute_logits(hidden, float32) / float(self.cfg.hf_config.get("logits_scaling", 1.0))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: Llama whose checkpoint already fuses q/k/v (``qkv_proj``) and
    gate/up (``gate_up_proj``); partial rotary where the config asks.  Under tensor
    parallelism each fused tensor is split per part at load (this rank's q, k and v
    heads; its gate and up rows)."""

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        return frozenset(
            {
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight",
            }
        )

    def finish_layer(self, layer: LlamaLayer, w: dict[str, Any], param) -> None:
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        layer.qkv = param(w["self_attn.qkv_proj.weight"])  # rows: q, k, v
        layer.qkv_bias = layer.q_norm = layer.k_norm = None
        layer.o = param(w["self_attn.o_proj.weight"])
        layer.gate_up = param(w["mlp.gate_up_proj.weight"])  # rows: gate, up
        layer.down = param(w["mlp.down_proj.weight"])


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with each head's q and k RMS-normalised before RoPE, no biases by
    default, and an explicit head_dim (heads * head_dim may differ from hidden_size)."""

    qk_norm = True
