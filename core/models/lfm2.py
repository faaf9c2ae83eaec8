"""LFM2 (``Lfm2ForCausalLM``): gated short-convolution layers beside attention layers
(``layer_types``: ``conv`` or ``full_attention``), each followed by a SiLU-gated MLP.

- Conv layer: ``in_proj`` [3 * hidden, hidden] gives B, C and x; the product ``B * x``
  goes through a causal depthwise convolution of width ``conv_L_cache`` without an
  activation (``ops.causal_conv1d``; ``ops.causal_conv1d_update`` for decode), is gated
  by C and projected by ``out_proj``.  Its window (``[hidden, width - 1]``) lives in the
  request's state pages (pagedserve.models.recurrent).
- Attention: RMS norm of each query and key head (``q_layernorm``, ``k_layernorm``)
  before RoPE; output ``out_proj``.
- MLP ``w2(silu(w1(x)) * w3(x))``; the final norm is ``model.embedding_norm``.
- Tensor parallelism: each rank keeps a contiguous share of the conv layer's hidden
  channels (B, C and x rows of ``in_proj``, the convolution, the columns of
  ``out_proj``) and of its window; attention splits by heads, the MLP by intermediate
  rows; each output is summed over the ranks before its (whole) bias is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache, even_slice, shard_parts
from pagedserve.models.layers import (
    add_rms_norm,
    fuse,
    gated_mlp,
    head_rms_norm,
    layer_windows,
    linear,
    paged_attention,
    qkv_split,
)
from pagedserve.models.recurrent import StateLayout, chunk_info, run_segmented

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Lfm2ForCausalLM", "Lfm2Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class Lfm2Layer:
    """One layer's weights.  ``conv_layer``: True for a short-convolution layer (in_proj
    [3 * hidden, hidden], in_bias, conv [hidden, width], conv_bias, out_proj, out_bias;
    biases None without ``conv_bias``); else qkv, q_norm, k_norm [head_dim], o.  MLP:
    gate_up (w1 rows then w3 rows), down."""

    __slots__ = (
        "conv_layer",
        "input_norm",
        "post_norm",
        "qkv",
        "q_norm",
        "k_norm",
        "o",
        "in_proj",
        "in_bias",
        "conv",
        "conv_bias",
        "out_proj",
        "out_bias",
        "gate_up",
        "down",
    )


class Lfm2ForCausalLM(DecoderForCausalLM):
    layer_class = Lfm2Layer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "gate_up", "down")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        types = cfg.hf_config.get("layer_types")
        if types is None:
            raise ValueError(f"{cfg.architecture}: the config has no layer_types")
        unknown = sorted(set(types) - {"conv", "full_attention"})
        if unknown:
            raise ValueError(f"{cfg.architecture}: layer types {unknown} are not supported (conv, full_attention)")
        if int(cfg.hf_config.get("conv_L_cache", 3)) < 2:
            raise ValueError(f"{cfg.architecture}: conv_L_cache must be at least 2")

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        if int(hf["hidden_size"]) % tp:
            return f"it must divide the short convolution's channels (hidden_size={hf['hidden_size']})"
        return None

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.eps = float(hf.get("norm_eps", cfg.rms_norm_eps))
        self.width = int(hf.get("conv_L_cache", 3))
        self.conv_bias = bool(hf.get("conv_bias", False))
        #: This rank's share of the conv layers' channels.
        self.channels = cfg.hidden_size // self.parallel.tp_size
        self.state = StateLayout([(self.channels, self.width - 1)], self.dtype)

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """The conv layer's tensors by channels, attention's ``out_proj`` by heads (see the
        module); the rest as every family.  Row-parallel biases stay whole."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        parts = local.split(".")
        if parts[:2] == ["conv", "in_proj"]:  # B, C, x (weight and bias)
            hidden = self.cfg.hidden_size
            return shard_parts(local, t, [hidden] * 3, r, tp)
        if parts[:2] == ["conv", "conv"]:
            return even_slice(local, t, 0, r, tp)
        if parts[1] == "out_proj" and parts[2] == "weight":
            if parts[0] == "conv":
                return even_slice(local, t, 1, r, tp)
            return t[:, r * self.q_size : (r + 1) * self.q_size]  # attention's o_proj
        return super().shard_layer_tensor(local, t)

    # -- weights ------------------------------------------------------------------------------
    def load_global(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "model.embedding_norm.weight":  # the final norm
            self.norm = self._param(tensor, self.head_device)
            return True
        return False

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"operator_norm.weight", "ffn_norm.weight"}
        names |= {f"feed_forward.{p}.weight" for p in ("w1", "w2", "w3")}
        if self.windows[layer] is None:
            names |= {f"self_attn.{p}.weight" for p in (*_ATTN, "out_proj", "q_layernorm", "k_layernorm")}
        else:
            names |= {"conv.conv.weight", "conv.in_proj.weight", "conv.out_proj.weight"}
            if self.conv_bias:
                names |= {"conv.conv.bias", "conv.in_proj.bias", "conv.out_proj.bias"}
        return frozenset(names)

    def finish_layer(self, layer: Lfm2Layer, w: dict[str, Any], param) -> None:
        for name in Lfm2Layer.__slots__:
            setattr(layer, name, None)
        layer.input_norm = param(w["operator_norm.weight"])
        layer.post_norm = param(w["ffn_norm.weight"])
        layer.conv_layer = "conv.conv.weight" in w
        if layer.conv_layer:
            layer.in_proj = param(w["conv.in_proj.weight"])
            layer.conv = param(w["conv.conv.weight"].reshape(self.channels, self.width))
            layer.out_proj = param(w["conv.out_proj.weight"])
            if self.conv_bias:
                layer.in_bias = param(w["conv.in_proj.bias"])
                layer.conv_bias = param(w["conv.conv.bias"])
                layer.out_bias = param(w["conv.out_proj.bias"])
        else:
            a = "self_attn."
            layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
            layer.q_norm = param(w[a + "q_layernorm.weight"])
            layer.k_norm = param(w[a + "k_layernorm.weight"])
            layer.o = param(w[a + "out_proj.weight"])
        f = "feed_forward."
        layer.gate_up = param(fuse([w[f + "w1.weight"], w[f + "w3.weight"]]))
        layer.down = param(w[f + "w2.weight"])

    # -- forward ------------------------------------------------------------------------------
    def _short_conv(
        self, ops, layer: Lfm2Layer, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The gated short convolution: projections once over the step's tokens, the
        convolution (:meth:`_conv`) in segments where checkpoints are due."""
        B, C, x = linear(ops, h, layer.in_proj, layer.in_bias).chunk(3, dim=-1)
        (y,) = run_segmented(
            lambda xs, m, st: (self._conv(ops, layer, xs[0], st, m),), (B * x,), kv_cache, meta, self.state
        )
        out = self.parallel.all_reduce(linear(ops, C * y, layer.out_proj))  # row-parallel: summed over the ranks
        return out if layer.out_bias is None else out + layer.out_bias

    def _conv(
        self, ops, layer: Lfm2Layer, bx: torch.Tensor, states: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The convolution over ``states`` (the rows' windows, updated in place)."""
        has_state, decode = chunk_info(meta)
        (window,) = states
        if decode:
            y = ops.causal_conv1d_update(bx, layer.conv, layer.conv_bias, window, None)
        else:
            y = ops.causal_conv1d(bx, layer.conv, layer.conv_bias, window, meta.query_start_loc, has_state, None)
        return y

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Lfm2Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, self.eps)
        if layer.conv_layer:
            h = self._short_conv(ops, layer, h, kv_cache, meta)
        else:
            q, k, v = qkv_split(linear(ops, h, layer.qkv), self.attn)
            q, k = head_rms_norm(ops, q, layer.q_norm, self.eps), head_rms_norm(ops, k, layer.k_norm, self.eps)
            q, k = self.rope(ops, placement, meta.positions, q, k)
            h = self.parallel.all_reduce(
                linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o)
            )
        h, residual = ops.fused_add_rms_norm(h, residual, layer.post_norm, self.eps)
        return self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down)), residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.eps)
        return h
