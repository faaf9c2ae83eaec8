"""Jamba (``JambaForCausalLM``): Mamba 1 layers and attention layers (attention where
``i % attn_layer_period == attn_layer_offset``), each followed by a SiLU-gated MLP or,
where ``i % expert_layer_period == expert_layer_offset``, a routed MoE (softmax over
every expert, top-k weights not renormalised).

- Mamba 1 layer: ``in_proj`` gives x and the output gate z; a causal depthwise
  convolution with bias and SiLU over x (``ops.causal_conv1d``); ``x_proj`` gives the
  step's low-rank input, B and C, each RMS-normalised (``dt_layernorm``, ``b_layernorm``,
  ``c_layernorm``); ``dt = softplus(dt_proj(.))``, ``A = -exp(A_log)`` [d_inner,
  d_state]; the selective scan (``ops.mamba1_scan`` in chunks for prefill,
  ``ops.mamba1_scan_step`` for decode) with skip D, gated by ``silu(z)``, then
  ``out_proj``.  Its state (convolution window and ``[d_inner, d_state]``) lives in the
  request's state pages (pagedserve.models.recurrent).
- Attention: no rotary embedding.
- Tensor parallelism: each rank keeps a contiguous share of the Mamba layer's
  ``d_inner`` channels (x and z rows of ``in_proj``, the convolution, ``dt_proj``'s
  rows and bias, ``A_log``, ``D``, ``out_proj``'s columns) and of their state.
  ``x_proj`` reads every channel, so it is row-parallel: the ranks' partial step
  inputs, B and C are summed before their norms.  Attention splits by heads, the MLP
  and experts by intermediate rows; mixer and MLP outputs are summed over the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache, even_slice
from pagedserve.models.layers import (
    add_rms_norm,
    fuse,
    gated_mlp,
    layer_windows,
    linear,
    paged_attention,
    qkv_split,
    route_topk,
)
from pagedserve.models.quantized_experts import quantized_experts_moe, stack_experts
from pagedserve.models.recurrent import StateLayout, chunk_info, run_segmented

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["JambaForCausalLM", "JambaLayer"]

_ATTN = ("q_proj", "k_proj", "v_proj")
_MAMBA = ("A_log", "D", "conv1d.weight", "in_proj.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias")
_MAMBA_NORMS = ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")


class JambaLayer:
    """One layer's weights.  ``mamba``: True for a Mamba 1 layer (in_proj [2 * d_inner,
    hidden], conv [d_inner, width], conv_bias, x_proj [rank + 2 * d_state, d_inner],
    dt_norm, b_norm, c_norm, dt_proj [d_inner, rank], dt_bias, A (float32 [d_inner,
    d_state]), D, out_proj); else qkv, o.  Feed-forward: router [E, hidden], w13, w2
    (stacked experts) or gate_up, down."""

    __slots__ = (
        "mamba",
        "input_norm",
        "post_norm",
        "qkv",
        "o",
        "in_proj",
        "conv",
        "conv_bias",
        "x_proj",
        "dt_norm",
        "b_norm",
        "c_norm",
        "dt_proj",
        "dt_bias",
        "A",
        "D",
        "out_proj",
        "router",
        "w13",
        "w2",
        "gate_up",
        "down",
    )


class JambaForCausalLM(DecoderForCausalLM):
    layer_class = JambaLayer
    linear_fields = ("qkv", "o", "in_proj", "x_proj", "dt_proj", "out_proj", "gate_up", "down")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
        if hf.get("mamba_proj_bias"):
            raise ValueError(f"{cfg.architecture}: mamba_proj_bias=true is not supported")
        if int(hf.get("attn_layer_offset", 4)) >= int(hf.get("attn_layer_period", 8)):
            raise ValueError(f"{cfg.architecture}: attn_layer_offset must be smaller than attn_layer_period")

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        d_inner = int(hf.get("mamba_expand", 2)) * int(hf["hidden_size"])
        if d_inner % tp:
            return f"it must divide the Mamba channels (mamba_expand * hidden_size = {d_inner})"
        return None

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.d_state, self.width = int(hf.get("mamba_d_state", 16)), int(hf.get("mamba_d_conv", 4))
        #: This rank's share of the Mamba channels.
        self.d_inner = int(hf.get("mamba_expand", 2)) * cfg.hidden_size // self.parallel.tp_size
        rank = hf.get("mamba_dt_rank", "auto")
        self.rank = -(-cfg.hidden_size // 16) if rank == "auto" else int(rank)
        self.state = StateLayout([(self.d_inner, self.width - 1), (self.d_inner, self.d_state)], self.dtype)
        self.num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 1)
        self.top_k = int(hf.get("num_experts_per_tok", 2))
        period, offset = int(hf.get("expert_layer_period", 2)), int(hf.get("expert_layer_offset", 1))
        self.moe_layers = [self.num_experts > 1 and i % period == offset for i in range(cfg.num_layers)]

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """The Mamba layer's tensors by channels (see the module); the rest as every family."""
        parts = local.split(".")
        if parts[0] != "mamba":
            return super().shard_layer_tensor(local, t)
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        if parts[1] == "in_proj":  # x rows then z rows
            return torch.cat([even_slice(local, half, 0, r, tp) for half in t.chunk(2)])
        if parts[1] in ("conv1d", "dt_proj", "A_log", "D"):
            return even_slice(local, t, 0, r, tp)
        if parts[1] in ("x_proj", "out_proj"):
            return even_slice(local, t, 1, r, tp)
        return t  # the step, B and C norms

    # -- weights ------------------------------------------------------------------------------
    def load_global(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "model.final_layernorm.weight":
            self.norm = self._param(tensor, self.head_device)
            return True
        return False

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "pre_ff_layernorm.weight"}
        if self.windows[layer] is None:
            names |= {f"self_attn.{p}.weight" for p in (*_ATTN, "o_proj")}
        else:
            names |= {"mamba." + n for n in (*_MAMBA, *_MAMBA_NORMS, "out_proj.weight")}
            if self.cfg.hf_config.get("mamba_conv_bias", True):
                names.add("mamba.conv1d.bias")
        f = "feed_forward."
        if self.moe_layers[layer]:
            names.add(f + "router.weight")
            names |= {f"{f}experts.{e}.{p}.weight" for e in range(self.num_experts) for p in ("gate_proj", "up_proj")}
            names |= {f"{f}experts.{e}.down_proj.weight" for e in range(self.num_experts)}
        else:
            names |= {f + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")}
        return frozenset(names)

    def finish_layer(self, layer: JambaLayer, w: dict[str, Any], param) -> None:
        for name in JambaLayer.__slots__:
            setattr(layer, name, None)
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["pre_ff_layernorm.weight"])
        layer.mamba = "mamba.A_log" in w
        if layer.mamba:
            m = "mamba."
            layer.in_proj = param(w[m + "in_proj.weight"])
            layer.conv = param(w[m + "conv1d.weight"].reshape(self.d_inner, self.width))
            layer.conv_bias = param(w[m + "conv1d.bias"]) if m + "conv1d.bias" in w else None
            layer.x_proj = param(w[m + "x_proj.weight"])
            layer.dt_norm = param(w[m + "dt_layernorm.weight"])
            layer.b_norm = param(w[m + "b_layernorm.weight"])
            layer.c_norm = param(w[m + "c_layernorm.weight"])
            layer.dt_proj = param(w[m + "dt_proj.weight"])
            layer.dt_bias = param(w[m + "dt_proj.bias"]).float()
            layer.A = -param(w[m + "A_log"]).float().exp()
            layer.D = param(w[m + "D"]).float()
            layer.out_proj = param(w[m + "out_proj.weight"])
        else:
            a = "self_attn."
            layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
            layer.o = param(w[a + "o_proj.weight"])
        f = "feed_forward."
        if f + "router.weight" in w:
            experts = range(self.num_experts)
            layer.router = param(w[f + "router.weight"])
            gate_up = [[w[f"{f}experts.{e}.gate_proj.weight"], w[f"{f}experts.{e}.up_proj.weight"]] for e in experts]
            down = [w[f"{f}experts.{e}.down_proj.weight"] for e in experts]
            layer.w13, layer.w2 = stack_experts(gate_up, down, param, fuse, f"{self.cfg.architecture} experts")
        else:
            layer.gate_up = param(fuse([w[f + "gate_proj.weight"], w[f + "up_proj.weight"]]))
            layer.down = param(w[f + "down_proj.weight"])

    def prepare_linear_weights(self) -> None:
        super().prepare_linear_weights()
        self.prepare_stacked_experts()

    # -- forward ------------------------------------------------------------------------------
    def _mamba(self, ops, layer: JambaLayer, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata):
        """The Mamba mixer: its input and output projections once over the step's tokens,
        the rest (:meth:`_mamba_scan`) in segments where checkpoints are due."""
        xs, z = linear(ops, h, layer.in_proj).chunk(2, dim=-1)
        (y,) = run_segmented(
            lambda t, m, st: (self._mamba_scan(ops, layer, t[0], st, m),), (xs,), kv_cache, meta, self.state
        )
        return linear(ops, y * F.silu(z), layer.out_proj)

    def _mamba_scan(
        self, ops, layer: JambaLayer, xs: torch.Tensor, states: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The convolution, the (small) projections of its output to the step sizes and B, C,
        and the selective scan over ``states`` (updated in place): y [n, d_inner]."""
        eps = self.cfg.rms_norm_eps
        has_state, decode = chunk_info(meta)
        conv_state, state = states
        if decode:
            xs = ops.causal_conv1d_update(xs, layer.conv, layer.conv_bias, conv_state, "silu")
        else:
            xs = ops.causal_conv1d(xs, layer.conv, layer.conv_bias, conv_state, meta.query_start_loc, has_state, "silu")
        # Row-parallel: every rank's channels contribute to the step inputs, B and C.
        proj = self.parallel.all_reduce(linear(ops, xs, layer.x_proj))
        ts, B, C = proj.split([self.rank, self.d_state, self.d_state], dim=-1)
        ts = ops.rms_norm(ts.contiguous(), layer.dt_norm, eps)
        B = ops.rms_norm(B.contiguous(), layer.b_norm, eps)
        C = ops.rms_norm(C.contiguous(), layer.c_norm, eps)
        dt = F.softplus(linear(ops, ts, layer.dt_proj).float() + layer.dt_bias)
        if decode:
            y = ops.mamba1_scan_step(xs, dt, layer.A, B, C, layer.D, state)
        else:
            y = ops.mamba1_scan(xs, dt, layer.A, B, C, layer.D, state, meta.query_start_loc)
        return y

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: JambaLayer,
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
            h = linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o)
        # Row-parallel out_proj / o_proj and down projections: summed over the ranks.
        h, residual = ops.fused_add_rms_norm(self.parallel.all_reduce(h), residual, layer.post_norm, eps)
        if layer.w13 is None:
            return self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down)), residual
        weights, ids = route_topk(linear(ops, h, layer.router), self.top_k, renormalize=False)
        if isinstance(layer.w13, list):  # quantized experts (GGUF blocks kept), one weight each
            return self.parallel.all_reduce(quantized_experts_moe(ops, h, layer.w13, layer.w2, weights, ids)), residual
        return self.parallel.all_reduce(ops.fused_moe(h, layer.w13, layer.w2, weights, ids, "silu")), residual
