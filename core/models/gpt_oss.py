"""GPT-OSS: pre-norm decoder layers of biased GQA attention with per-head attention
sinks, alternating sliding-window / full layers (``layer_types``), YaRN RoPE, and a
mixture-of-experts MLP with a biased router, biased experts and the clamped SwiGLU
("swigluoai": ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate)``).

Checkpoint layout (transformers' ``GptOssForCausalLM``): per layer ``self_attn.sinks``
[heads]; ``mlp.router.{weight,bias}`` [E, hidden], [E]; ``mlp.experts.gate_up_proj``
[E, hidden, 2 * I] whose columns interleave gate and up (gate at even columns) with
``gate_up_proj_bias`` [E, 2 * I]; ``mlp.experts.down_proj`` [E, I, hidden] with
``down_proj_bias`` [E, hidden].  At load the experts become the ``fused_moe`` op's
layout: ``w13`` [E, 2 * I, hidden] = cat(gate rows, up rows), ``w2`` [E, hidden, I].

The released checkpoints store the expert weights as MXFP4 (``quantization_config``
``quant_method = "mxfp4"``: ``gate_up_proj_blocks`` / ``_scales`` [E, 2I, hidden / 32,
16] / [E, 2I, hidden / 32] with interleaved gate/up rows, ``down_proj_blocks`` /
``_scales`` [E, hidden, I / 32, 16] / [E, hidden, I / 32]); they are dequantized at
load to the model dtype (:mod:`pagedserve.models.mxfp4`).

Tensor parallelism splits attention by heads (each rank keeps its query heads' sinks) and
every expert's intermediate dimension (its rows of gate and up -- whole gate/up pairs of
the interleaved columns -- and its columns of down; MXFP4 blocks split along whole
blocks), as the MoE families do; the router is replicated.  The row-parallel biases
(``o_proj.bias``, ``down_proj_bias``) are kept by rank 0 alone (zeros elsewhere), so the
all-reduce of the partial sums adds each once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache, even_slice
from pagedserve.models.layers import add_rms_norm, fuse, layer_windows, linear, paged_attention, qkv_split
from pagedserve.models.mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["GptOssForCausalLM", "GptOssLayer", "deinterleave_gate_up"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class GptOssLayer:
    """One decoder layer: fused qkv [q+2kv, hidden] and its bias, o [hidden, q] and its
    bias, sinks float32 [heads], router [E, hidden] and bias [E], experts w13
    [E, 2I, hidden] / w13_bias [E, 2I] and w2 [E, hidden, I] / w2_bias [E, hidden]."""

    __slots__ = (
        "input_norm",
        "post_norm",
        "qkv",
        "qkv_bias",
        "o",
        "o_bias",
        "sinks",
        "router",
        "router_bias",
        "w13",
        "w13_bias",
        "w2",
        "w2_bias",
    )


def deinterleave_gate_up(gate_up: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' gate_up_proj [E, hidden, 2I] (gate at even columns, up at odd) and
    its bias [E, 2I] -> (w13 [E, 2I, hidden] = cat(gate, up) rows, bias [E, 2I] likewise)."""
    w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    return w13, torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1).contiguous()


class GptOssForCausalLM(DecoderForCausalLM):
    """Inference-only GPT-OSS (see the module docstring); any tensor/pipeline split."""

    layer_class = GptOssLayer
    linear_fields = ("qkv", "o")
    default_attention_bias = True

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        layer_windows(hf, cfg.num_layers)
        if not cfg.attention_bias:
            raise ValueError(f"{cfg.architecture}: attention_bias=false is not supported")
        if int(hf["num_experts_per_tok"]) > int(hf["num_local_experts"]):
            raise ValueError(
                f"{cfg.architecture}: num_experts_per_tok={hf['num_experts_per_tok']} exceeds "
                f"num_local_experts={hf['num_local_experts']}"
            )

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.num_experts = int(hf["num_local_experts"])
        self.top_k = int(hf["num_experts_per_tok"])
        qcfg = hf.get("quantization_config") or {}
        #: Whether the expert weights come as MXFP4 blocks and scales.
        self.mxfp4 = str(qcfg.get("quant_method", "")).lower() == "mxfp4"
        self.swiglu = {"alpha": float(hf.get("swiglu_alpha", 1.702)), "limit": float(hf.get("swiglu_limit", 7.0))}

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks"}
        names |= {f"self_attn.{p}.{leaf}" for p in (*_ATTN, "o_proj") for leaf in ("weight", "bias")}
        names |= {"mlp.router.weight", "mlp.router.bias"}
        names |= {"mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"}
        suffixes = ("_blocks", "_scales") if self.mxfp4 else ("",)
        names |= {f"mlp.experts.{p}{s}" for p in ("gate_up_proj", "down_proj") for s in suffixes}
        return frozenset(names)

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice (see the module docstring); attention weights as the decoder
        splits them."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        name = local.removeprefix("mlp.")
        if local == "self_attn.sinks":
            return t[r * self.num_heads : (r + 1) * self.num_heads]
        if local in ("self_attn.o_proj.bias", "mlp.experts.down_proj_bias"):
            return t if r == 0 else torch.zeros_like(t)
        # The intermediate dimension: gate_up's last (interleaved pairs stay whole), its
        # MXFP4 blocks' and scales' rows; down's rows, its MXFP4 blocks' and scales' blocks.
        dims = {
            "experts.gate_up_proj": -1,
            "experts.gate_up_proj_bias": -1,
            "experts.gate_up_proj_blocks": 1,
            "experts.gate_up_proj_scales": 1,
            "experts.down_proj": 1,
            "experts.down_proj_blocks": 2,
            "experts.down_proj_scales": 2,
        }
        if name in dims:
            return even_slice(local, t, dims[name] % t.dim(), r, tp)
        return super().shard_layer_tensor(local, t)

    def finish_layer(self, layer: GptOssLayer, w: dict[str, Any], param) -> None:
        a, e = "self_attn.", "mlp.experts."
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.qkv_bias = param(torch.cat([w[a + p + ".bias"] for p in _ATTN]))
        layer.o = param(w[a + "o_proj.weight"])
        layer.o_bias = param(w[a + "o_proj.bias"])
        # In the model dtype, as transformers holds them, then float32 for the op.
        layer.sinks = param(w[a + "sinks"]).float()
        layer.router = param(w["mlp.router.weight"])
        layer.router_bias = param(w["mlp.router.bias"])
        if self.mxfp4:  # [E, 2I, hidden] with interleaved gate/up rows; [E, hidden, I]
            gate_up = dequantize_mxfp4(w[e + "gate_up_proj_blocks"], w[e + "gate_up_proj_scales"], self.dtype)
            gate_up = gate_up.transpose(1, 2)  # transformers' [E, hidden, 2I]
            down = dequantize_mxfp4(w[e + "down_proj_blocks"], w[e + "down_proj_scales"], self.dtype)
        else:
            gate_up, down = w[e + "gate_up_proj"], w[e + "down_proj"].transpose(1, 2)
        w13, b13 = deinterleave_gate_up(gate_up, w[e + "gate_up_proj_bias"])
        layer.w13, layer.w13_bias = param(w13), param(b13)
        layer.w2 = param(down.contiguous())
        layer.w2_bias = param(w[e + "down_proj_bias"])

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: GptOssLayer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
        q, k = self.rope(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale, self.windows[index], sinks=layer.sinks)
        x = self.parallel.all_reduce(linear(ops, attn, layer.o, layer.o_bias))
        h, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, eps)
        return self.parallel.all_reduce(self.moe(ops, layer, h)), residual

    def moe(self, ops, layer: GptOssLayer, h: torch.Tensor) -> torch.Tensor:
        """Router (biased; softmax over each token's top-k logits), then the experts:
        h [n, hidden] -> [n, hidden]."""
        logits = linear(ops, h, layer.router, layer.router_bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
        return ops.fused_moe(
            h, layer.w13, layer.w2, weights, ids, "swigluoai", layer.w13_bias, layer.w2_bias, **self.swiglu
        )
