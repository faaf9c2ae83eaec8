"""Granite 4 (``GraniteMoeHybridForCausalLM``): Mamba 2 layers and attention layers
(``layer_types``), each followed by a routed MoE plus a shared gated MLP, with Granite's
embedding, attention, residual and logits multipliers.

- Mamba 2 layer: one input projection (output gate z, the convolution's x/B/C, and a
  step size per head), a causal depthwise convolution with bias and SiLU over x/B/C
  (``ops.causal_conv1d``, window in the request's state), the selective state space
  (``ops.mamba2_ssd`` in chunks for prefill, ``ops.mamba2_ssd_step`` for decode; step
  ``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``, skip ``D``), then
  ``rms_norm(y * silu(z))`` over ``n_groups`` groups (``ops.rms_norm_gated``) and the
  output projection.  Its state (convolution window and ``[heads, head_dim, d_state]``)
  lives in the request's state pages (pagedserve.models.recurrent).
- Attention: no rotary embedding unless ``position_embedding_type`` is ``rope``; the
  softmax scale is ``attention_multiplier``.
- MoE: softmax over the top-k router logits; experts stored stacked
  (``input_linear`` [E, 2 * I, hidden], gate rows then up rows; ``output_linear``).
- Tensor parallelism: the Mamba 2 layers split by heads and groups
  (:mod:`pagedserve.models.mamba2`), attention by heads, the experts and the shared MLP
  by their intermediate rows; the ranks' mixer and MLP outputs are summed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache, even_slice
from pagedserve.models.layers import add_rms_norm, fuse, gated_mlp, layer_windows, linear, paged_attention, qkv_split
from pagedserve.models.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["GraniteMoeHybridForCausalLM", "GraniteHybridLayer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


def _json_float(v: Any) -> float:
    """A number of config.json; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) else v)


class GraniteHybridLayer:
    """One layer's weights.  ``mamba``: True for a Mamba 2 layer (in_proj [d_inner +
    conv_dim + heads, hidden], conv [conv_dim, width], conv_bias, dt_bias, A (float32,
    = -exp(A_log)), D [heads], out_norm [d_inner], out_proj); else qkv, o.  MLP: router
    [E, hidden], w13 [E, 2 * I, hidden], w2 [E, hidden, I] (None without experts), and
    the shared MLP's gate_up, down."""

    __slots__ = (
        "mamba",
        "input_norm",
        "post_norm",
        "qkv",
        "o",
        "in_proj",
        "conv",
        "conv_bias",
        "dt_bias",
        "A",
        "D",
        "out_norm",
        "out_proj",
        "router",
        "w13",
        "w2",
        "gate_up",
        "down",
    )


class GraniteMoeHybridForCausalLM(Mamba2Mixer, DecoderForCausalLM):
    layer_class = GraniteHybridLayer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "gate_up", "down")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        if any(isinstance(w, int) for w in layer_windows(hf, cfg.num_layers)):
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
        if hf.get("mamba_proj_bias"):
            raise ValueError(f"{cfg.architecture}: mamba_proj_bias=true is not supported")
        if hf.get("position_embedding_type") not in (None, "nope", "rope"):
            raise ValueError(f"{cfg.architecture}: position_embedding_type {hf['position_embedding_type']!r}")
        heads, groups = int(hf["mamba_n_heads"]), int(hf.get("mamba_n_groups", 1))
        if heads % groups:
            raise ValueError(f"{cfg.architecture}: mamba_n_heads must be a multiple of mamba_n_groups")

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        heads, groups = int(hf["mamba_n_heads"]), int(hf.get("mamba_n_groups", 1))
        why = cls.mamba_refusal(heads, groups, tp, ("mamba_n_heads", "mamba_n_groups"))
        shared = int(hf.get("shared_intermediate_size") or 0)
        if why is None and shared % tp:
            why = f"it must divide the shared MLP's shared_intermediate_size ({shared})"
        return why

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        heads, head_dim = int(hf["mamba_n_heads"]), int(hf["mamba_d_head"])
        d_inner = int(hf.get("mamba_expand", 2) * cfg.hidden_size)
        if d_inner != heads * head_dim:
            raise ValueError(
                f"{cfg.architecture}: mamba_expand * hidden_size ({d_inner}) must equal "
                f"mamba_n_heads * mamba_d_head ({heads * head_dim})"
            )
        groups, d_state = int(hf.get("mamba_n_groups", 1)), int(hf["mamba_d_state"])
        self.set_mamba_shapes(heads, head_dim, groups, d_state, int(hf["mamba_d_conv"]))
        self.chunk = int(hf.get("mamba_chunk_size", 256))
        limit = hf.get("time_step_limit") or (0.0, math.inf)
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.num_experts = int(hf.get("num_local_experts") or 0)
        self.top_k = int(hf.get("num_experts_per_tok") or 0)
        self.use_rope = hf.get("position_embedding_type") == "rope"
        self.residual_multiplier = float(hf.get("residual_multiplier", 1.0))
        self.mamba_eps = cfg.rms_norm_eps

    def attention_scale(self) -> float:
        return float(self.cfg.hf_config.get("attention_multiplier", self.cfg.head_dim**-0.5))

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """Mamba 2 tensors by heads and groups; the stacked experts ([E, 2 * I, hidden] gate
        then up rows, [E, hidden, I]) and the shared MLP by intermediate rows."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        parts = local.split(".")
        if parts[0] == "mamba":
            return self.shard_mamba_tensor(parts[1], local, t)
        if parts[0] in ("block_sparse_moe", "shared_mlp") and parts[-2] in ("input_linear", "output_linear"):
            experts = parts[0] == "block_sparse_moe"
            if parts[-2] == "input_linear":
                dim = 1 if experts else 0
                return torch.cat([even_slice(local, half, dim, r, tp) for half in t.chunk(2, dim=dim)], dim=dim)
            return even_slice(local, t, 2 if experts else 1, r, tp)
        return super().shard_layer_tensor(local, t)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * float(self.cfg.hf_config.get("embedding_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return super().compute_logits(hidden, float32) / float(self.cfg.hf_config.get("logits_scaling", 1.0))

    # -- weights ------------------------------------------------------------------------------
    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight"}
        names |= {"shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"}
        if self.windows[layer] is None:
            names |= {f"self_attn.{p}.weight" for p in (*_ATTN, "o_proj")}
        else:
            m = "mamba."
            names |= {m + n for n in ("dt_bias", "A_log", "D", "conv1d.weight", "in_proj.weight", "norm.weight")}
            names |= {m + "out_proj.weight"}
            if self.cfg.hf_config.get("mamba_conv_bias", True):
                names.add(m + "conv1d.bias")
        if self.num_experts:
            b = "block_sparse_moe."
            names |= {b + "router.layer.weight", b + "input_linear.weight", b + "output_linear.weight"}
        return frozenset(names)

    def finish_layer(self, layer: GraniteHybridLayer, w: dict[str, Any], param) -> None:
        for name in GraniteHybridLayer.__slots__:
            setattr(layer, name, None)
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        layer.mamba = "mamba.A_log" in w
        if layer.mamba:
            m = "mamba."
            layer.in_proj = param(w[m + "in_proj.weight"])
            layer.conv = param(w[m + "conv1d.weight"].reshape(self.conv_dim, self.width))
            layer.conv_bias = param(w[m + "conv1d.bias"]) if m + "conv1d.bias" in w else None
            layer.dt_bias = param(w[m + "dt_bias"]).float()
            layer.A = -param(w[m + "A_log"]).float().exp()
            layer.D = param(w[m + "D"]).float()
            layer.out_norm = param(w[m + "norm.weight"])
            layer.out_proj = param(w[m + "out_proj.weight"])
        else:
            a = "self_attn."
            layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
            layer.o = param(w[a + "o_proj.weight"])
        if self.num_experts:
            b = "block_sparse_moe."
            layer.router = param(w[b + "router.layer.weight"])
            layer.w13 = param(w[b + "input_linear.weight"])
            layer.w2 = param(w[b + "output_linear.weight"])
        layer.gate_up = param(w["shared_mlp.input_linear.weight"])
        layer.down = param(w["shared_mlp.output_linear.weight"])

    def prepare_linear_weights(self) -> None:
        super().prepare_linear_weights()
        self.prepare_stacked_experts()

    # -- forward ------------------------------------------------------------------------------
    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: GraniteHybridLayer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        if layer.mamba:
            h = self._mamba(ops, layer, h, kv_cache, meta)
        else:
            q, k, v = qkv_split(linear(ops, h, layer.qkv), self.attn)
            if self.use_rope:
                q, k = self.rope(ops, placement, meta.positions, q, k)
            h = linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o)
        h = self.parallel.all_reduce(h)  # row-parallel out_proj / o_proj: summed over the ranks
        h, residual = ops.fused_add_rms_norm(h * self.residual_multiplier, residual, layer.post_norm, eps)
        out = gated_mlp(ops, h, layer.gate_up, layer.down)
        if layer.w13 is not None:
            logits = linear(ops, h, layer.router).float()
            top, ids = logits.topk(self.top_k, dim=-1)
            out = out + ops.fused_moe(h, layer.w13, layer.w2, torch.softmax(top, dim=-1), ids, "silu")
        return self.parallel.all_reduce(out) * self.residual_multiplier, residual
