"""Qwen3.5 (text) and Qwen3-Next: Gated DeltaNet linear-attention layers interleaved with
gated full attention (``layer_types``; 3 : 1 in the released checkpoints).

- Gated DeltaNet layer: one fused input projection (q, k, v for the short convolution,
  the output gate z, and the per-head write strength b and decay input a), a causal
  depthwise convolution with SiLU over q/k/v (``ops.causal_conv1d``, with its window in
  the request's state), the delta rule over L2-normalised q and k
  (``ops.gated_delta_rule`` in chunks for prefill, ``ops.gated_delta_rule_recurrent``
  for decode; decay ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``),
  a gated RMSNorm per value head (``ops.rms_norm_gated``) and the output projection.
  Its state (convolution window and ``[heads, dk, dv]`` matrix) lives in the request's
  state pages (pagedserve.models.recurrent; kv_cache/state_group.py).
- Gated attention: q_proj yields each head's query and an output gate side by side;
  per-head q/k RMSNorm, partial rotary (``partial_rotary_factor``), and the attention
  output times ``sigmoid(gate)`` before o_proj.
- Every RMSNorm but the DeltaNet's output norm multiplies by ``1 + w`` (folded in at load).
- Qwen3.5-MoE: the same layers with sparse MLPs (routed experts plus a sigmoid-gated
  shared expert) in every layer.
- Qwen3-Next: the same layers with Qwen2-MoE-style sparse MLPs (routed experts plus a
  sigmoid-gated shared expert) and its checkpoint's per-key-head packing of the DeltaNet
  projections (``in_proj_qkvz``, ``in_proj_ba``), reordered at load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

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
    route_topk,
)
from pagedserve.models.quantized_experts import quantized_experts_moe, stack_experts
from pagedserve.models.recurrent import StateLayout, chunk_info, run_segmented
from pagedserve.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class Qwen3_5Layer:
    """One layer's weights.  ``linear``: True for a Gated DeltaNet layer.  Attention:
    qkv [heads * 2 * d + 2 * kv_heads * d, hidden] (each head's query then gate, k, v),
    q_norm / k_norm [d] (holding 1 + w), o.  DeltaNet: in_proj [conv_dim + value_dim + 2 *
    v_heads, hidden] (q, k, v, z, b, a), conv [conv_dim, width], dt_bias, A (= -exp(A_log),
    float32) [v_heads], out_norm [dv], out_proj.  MLP: gate_up, down (dense or the shared
    expert), router, w13, w2, shared_gate (sparse)."""

    __slots__ = (
        "linear",
        "input_norm",
        "post_norm",
        "qkv",
        "q_norm",
        "k_norm",
        "o",
        "in_proj",
        "conv",
        "dt_bias",
        "A",
        "out_norm",
        "out_proj",
        "gate_up",
        "down",
        "router",
        "w13",
        "w2",
        "shared_gate",
    )


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """With tensor parallelism each rank holds a contiguous share of the DeltaNet's key
    heads and of their value heads (each value head reads key head ``j // (v_heads /
    k_heads)``, so the shares match): the q/k/v rows of ``in_proj`` and of the
    convolution, z, b, a, ``dt_bias``, ``A_log`` and the columns of ``out_proj``
    (row-parallel, summed over ranks), and its state holds only those heads.  The gated
    output norm is per value head, so it stays local."""

    layer_class = Qwen3_5Layer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "gate_up", "down")
    #: Sparse MLPs (Qwen3-Next).
    moe: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        windows = layer_windows(hf, cfg.num_layers)
        if any(isinstance(w, int) for w in windows):
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
        if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
            raise ValueError(f"{cfg.architecture}: linear_num_value_heads must be a multiple of linear_num_key_heads")

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        kh, vh = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
        if kh % tp:
            return (
                f"it must divide the Gated DeltaNet key heads (linear_num_key_heads={kh}; each rank keeps whole "
                f"key heads with their {vh // kh} value heads each)"
            )
        return None

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.is_linear = [t == "linear_attention" for t in hf["layer_types"]]
        tp = self.parallel.tp_size
        #: The checkpoint's DeltaNet key and value heads; this rank keeps a 1/tp share of each.
        self.global_heads = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
        self.k_heads, self.v_heads = self.global_heads[0] // tp, self.global_heads[1] // tp
        self.dk, self.dv = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
        self.width = int(hf["linear_conv_kernel_dim"])
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.state = StateLayout([(self.conv_dim, self.width - 1), (self.v_heads, self.dk, self.dv)], self.dtype)
        if self.moe:
            self.num_experts = int(hf["num_experts"])
            self.top_k = int(hf["num_experts_per_tok"])
            self.renormalize = bool(hf.get("norm_topk_prob", True))
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            dense = set(hf.get("mlp_only_layers") or [])
            self.sparse = [
                self.num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers)
            ]
        else:
            self.sparse = [False] * cfg.num_layers

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """The DeltaNet's tensors split by heads (see the class); the gated attention's
        ``q_proj`` by heads of query and gate rows; the rest as every family."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        parts = local.split(".")
        if parts[0] == "linear_attn":
            kh, vh = self.global_heads
            if parts[1] in ("in_proj_qkv", "conv1d"):  # q, k, v: each split by heads
                return shard_parts(local, t, [kh * self.dk, kh * self.dk, vh * self.dv], r, tp)
            if parts[1] in ("in_proj_z", "in_proj_b", "in_proj_a", "dt_bias", "A_log"):
                return even_slice(local, t, 0, r, tp)
            if parts[1] in ("in_proj_qkvz", "in_proj_ba"):  # Qwen3-Next: packed per key head
                return even_slice(local, t, 0, r, tp)
            if parts[1] == "out_proj":
                return even_slice(local, t, 1, r, tp)
            return t  # the per-head output norm
        if parts[-2] == "q_proj":  # each head's query then its output gate
            n = 2 * self.q_size
            return t[r * n : (r + 1) * n]
        return super().shard_layer_tensor(local, t)

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        # The final norm multiplies by (1 + w) too (a tied LM head keeps the plain embedding).
        self.norm = self._param(self.norm.float() + 1.0, self.head_device)

    # -- weights ------------------------------------------------------------------------------
    def linear_attn_names(self) -> set[str]:
        names = {"dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight"}
        names |= {f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")}
        return {"linear_attn." + n for n in names}

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight"}
        if self.is_linear[layer]:
            names |= self.linear_attn_names()
        else:
            names |= {f"self_attn.{p}.weight" for p in (*_ATTN, "o_proj", "q_norm", "k_norm")}
        if not self.sparse[layer]:
            return frozenset(names | {f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})
        names |= {"mlp.gate.weight", "mlp.shared_expert_gate.weight"}
        names |= {f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= {
            f"mlp.experts.{e}.{p}.weight"
            for e in range(self.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        return frozenset(names)

    def linear_in_proj(self, w: dict[str, Any]) -> list[torch.Tensor]:
        """The DeltaNet input projections in the order q, k, v, z, b, a."""
        a = "linear_attn."
        return [w[a + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]

    def finish_layer(self, layer: Qwen3_5Layer, w: dict[str, Any], param) -> None:
        for name in Qwen3_5Layer.__slots__:
            setattr(layer, name, None)
        one_plus = lambda t: param(t.float() + 1.0)  # noqa: E731
        layer.input_norm = one_plus(w["input_layernorm.weight"])
        layer.post_norm = one_plus(w["post_attention_layernorm.weight"])
        layer.linear = "linear_attn.dt_bias" in w
        if layer.linear:
            a = "linear_attn."
            layer.in_proj = param(fuse(self.linear_in_proj(w)))
            layer.conv = param(w[a + "conv1d.weight"].reshape(self.conv_dim, self.width))
            layer.dt_bias = param(w[a + "dt_bias"]).float()
            layer.A = -param(w[a + "A_log"]).float().exp()
            layer.out_norm = param(w[a + "norm.weight"])
            layer.out_proj = param(w[a + "out_proj.weight"])
        else:
            a = "self_attn."
            layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
            layer.q_norm = one_plus(w[a + "q_norm.weight"])
            layer.k_norm = one_plus(w[a + "k_norm.weight"])
            layer.o = param(w[a + "o_proj.weight"])
        if "mlp.gate.weight" in w:
            m = "mlp."
            experts = range(self.num_experts)
            layer.router = param(w[m + "gate.weight"])
            gate_up = [[w[f"{m}experts.{e}.gate_proj.weight"], w[f"{m}experts.{e}.up_proj.weight"]] for e in experts]
            down = [w[f"{m}experts.{e}.down_proj.weight"] for e in experts]
            layer.w13, layer.w2 = stack_experts(gate_up, down, param, fuse, self.cfg.architecture)
            s = m + "shared_expert."
            layer.gate_up = param(fuse([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]]))
            layer.down = param(w[s + "down_proj.weight"])
            layer.shared_gate = param(w[m + "shared_expert_gate.weight"])
        else:
            layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
            layer.down = param(w["mlp.down_proj.weight"])

    def prepare_linear_weights(self) -> None:
        super().prepare_linear_weights()
        self.prepare_stacked_experts()

    # -- forward ------------------------------------------------------------------------------
    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Qwen3_5Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        if layer.linear:
            h = self._delta_net(ops, layer, h, kv_cache, meta)
        else:
            h = self._gated_attention(ops, placement, layer, h, kv_cache, meta)
        # Row-parallel out_proj / o_proj and down projections: summed over the ranks.
        h, residual = ops.fused_add_rms_norm(self.parallel.all_reduce(h), residual, layer.post_norm, eps)
        return self.parallel.all_reduce(self._mlp(ops, layer, h)), residual

    def _gated_attention(
        self, ops, placement: int, layer: Qwen3_5Layer, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, a, eps = h.shape[0], self.attn, self.cfg.rms_norm_eps
        qg, k, v = linear(ops, h, layer.qkv).split([2 * a.q_size, a.kv_size, a.kv_size], dim=-1)
        qg = qg.view(n, a.num_heads, 2 * a.head_dim)
        q, gate = qg[..., : a.head_dim].contiguous(), qg[..., a.head_dim :].reshape(n, a.q_size)
        q = head_rms_norm(ops, q, layer.q_norm, eps)
        k = head_rms_norm(ops, k.reshape(n, a.num_kv_heads, a.head_dim), layer.k_norm, eps)
        v = v.reshape(n, a.num_kv_heads, a.head_dim)
        q, k = self.rope(ops, placement, meta.positions, q, k)
        out = paged_attention(ops, q, k, v, kv_cache, meta, a.scale) * torch.sigmoid(gate)
        return linear(ops, out, layer.o)

    def _delta_net(
        self, ops, layer: Qwen3_5Layer, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The DeltaNet mixer: its projections and gates once over the step's tokens, the
        convolution and scan (:meth:`_delta_scan`) in segments where checkpoints are due."""
        n = h.shape[0]
        mixed, z, b, a = linear(ops, h, layer.in_proj).split(
            [self.conv_dim, self.value_dim, self.v_heads, self.v_heads], dim=-1
        )
        beta = torch.sigmoid(b.float())
        g = layer.A * F.softplus(a.float() + layer.dt_bias)
        (o,) = run_segmented(
            lambda xs, m, st: (self._delta_scan(ops, layer, *xs, st, m),), (mixed, g, beta), kv_cache, meta, self.state
        )
        o = ops.rms_norm_gated(o.reshape(-1, self.dv), z.reshape(-1, self.dv), layer.out_norm, self.cfg.rms_norm_eps)
        return linear(ops, o.reshape(n, self.value_dim), layer.out_proj)

    def _delta_scan(
        self,
        ops,
        layer: Qwen3_5Layer,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The convolution and the gated delta rule over ``states`` (the rows' convolution
        windows and DeltaNet states, updated in place): o [n, v_heads, dv]."""
        n = mixed.shape[0]
        has_state, decode = chunk_info(meta)
        conv_state, state = states
        if decode:
            mixed = ops.causal_conv1d_update(mixed, layer.conv, None, conv_state, "silu")
        else:
            mixed = ops.causal_conv1d(mixed, layer.conv, None, conv_state, meta.query_start_loc, has_state, "silu")
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.k_heads, self.dk), k.reshape(n, self.k_heads, self.dk)
        v = v.reshape(n, self.v_heads, self.dv)
        if decode:
            o = ops.gated_delta_rule_recurrent(q, k, v, g, beta, state, True)
        else:
            o = ops.gated_delta_rule(q, k, v, g, beta, state, meta.query_start_loc, True)
        return o

    def _mlp(self, ops, layer: Qwen3_5Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.w13 is None:
            return gated_mlp(ops, h, layer.gate_up, layer.down)
        weights, ids = route_topk(linear(ops, h, layer.router), self.top_k, self.renormalize)
        if isinstance(layer.w13, list):  # quantized experts (GGUF blocks kept), one weight each
            out = quantized_experts_moe(ops, h, layer.w13, layer.w2, weights, ids)
        else:
            out = ops.fused_moe(h, layer.w13, layer.w2, weights, ids, "silu")
        gate = torch.sigmoid(linear(ops, h, layer.shared_gate))
        return out + gate * gated_mlp(ops, h, layer.gate_up, layer.down)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text): Qwen3.5's layers with sparse MLPs (routed experts plus a
    sigmoid-gated shared expert) in every layer."""

    moe = True


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: sparse MLPs, and DeltaNet projections packed per key head."""

    moe = True

    def linear_attn_names(self) -> set[str]:
        names = {"dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight"}
        names |= {"in_proj_qkvz.weight", "in_proj_ba.weight"}
        return {"linear_attn." + n for n in names}

    def linear_in_proj(self, w: dict[str, Any]) -> list:
        """``in_proj_qkvz`` holds, for each key head, its q [dk], k [dk], then its value
        heads' v and z ([v_heads / k_heads * dv] each); ``in_proj_ba`` for each key head
        its value heads' b then a.  Their rows reordered to q, k, v, z and b, a (each
        head-major), as row selections, so a quantized weight (GGUF blocks) stays one."""
        a = "linear_attn."
        kh, r = self.k_heads, self.v_heads // self.k_heads
        qkvz = _select_rows(w[a + "in_proj_qkvz.weight"], _head_major(kh, [self.dk, self.dk, r * self.dv, r * self.dv]))
        ba = _select_rows(w[a + "in_proj_ba.weight"], _head_major(kh, [r, r]))
        return [qkvz, ba]


def _head_major(heads: int, sizes: list[int]) -> torch.Tensor:
    """Row order that turns per-head packed rows (each head: its ``sizes`` parts in turn)
    into each part for every head in turn."""
    per, offsets = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat(
        [torch.arange(h * per + off, h * per + off + n) for off, n in zip(offsets, sizes) for h in range(heads)]
    )


def _select_rows(t, rows: torch.Tensor):
    return t.select_rows(rows) if isinstance(t, QuantizedWeight) else t.index_select(0, rows)
