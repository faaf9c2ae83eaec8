"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``): multi-head latent attention (MLA)
and a mixture of routed experts plus always-on shared experts, as transformers implements
them.

MLA: the query comes straight from ``q_proj`` (V2-Lite) or through a low-rank
``q_a_proj`` -> RMSNorm -> ``q_b_proj``; ``kv_a_proj_with_mqa`` gives a compressed KV
latent of ``kv_lora_rank`` and one rope key of ``qk_rope_head_dim`` shared by every head;
the normed latent goes through ``kv_b_proj`` to each head's non-rotated key
(``qk_nope_head_dim``) and value (``v_head_dim``).

The KV cache holds the latent, not the decompressed keys and values: per token the
normed latent and the rotated rope key (``kv_lora_rank + qk_rope_head_dim`` values, 576
for V2/V2-Lite/V3), one "head" shared by all, stored as two halves in the layer's
ordinary (key, value) pair (``kv_cache_heads`` 1, ``kv_head_dim`` half of it), so
that allocation, swap, the host tier and prefix caching move it as any cache.  For
V2-Lite's shapes that is 576 values per token and layer instead of 2 x 16 heads x 192
(10.7x fewer).  Attention absorbs the key up-projection into the query (each head's
``q_nope`` times its ``W_UK`` gives a query over the latent), runs the ``mla_paged_attention``
op over the cached vectors (score = q_latent . latent + q_rope . k_rope; the value is the
latent), then applies each head's ``W_UV`` to the result, as vLLM's MLA backends do for
decode.  Prefill runs the same absorbed form.  ``kv_b_proj`` is kept as the two float
per-head matrices (a quantized one is dequantized at load).

RoPE pairs adjacent dimensions (transformers multiplies complex numbers); as for GLM-4
the rope rows of the query projection and of ``kv_a_proj_with_mqa`` are reordered evens
first, odds second at load, which turns it into pagedserve's rotate-half rotation without
changing any attention score.  The softmax scale takes YaRN's ``mscale_all_dim``
correction squared, as transformers does.

MoE: layers from ``first_k_dense_replace`` on route each token to ``num_experts_per_tok``
of ``n_routed_experts`` (softmax scores; ``greedy`` or ``group_limited_greedy`` over
``n_group`` groups keeping ``topk_group``), weights times ``routed_scaling_factor``, run
through the ``fused_moe`` op, plus ``n_shared_experts`` shared experts as one gated MLP.

Quantized linears (int8/w8a8/fp8 at load, GGUF blocks) keep their stored row order: the
rope rows of the query and of ``kv_a_proj_with_mqa`` are then reordered in the projection's
output at run time instead; experts stay one quantized weight each
(:mod:`pagedserve.models.quantized_experts`); norms and the router stay float.

Tensor parallelism splits the heads: each rank keeps its heads' rows of ``q_proj`` /
``q_b_proj`` and ``kv_b_proj`` and their columns of ``o_proj``; the latent projections
(``q_a_proj``, ``kv_a_proj_with_mqa``), their norms and the router are replicated, and
every expert's and the shared experts' intermediate dimension is split as for the other
MoE families.  The attention and MLP outputs are partial sums, all-reduced.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import RotaryEmbedding, add_rms_norm, fuse, gated_mlp, linear
from pagedserve.models.quantized_experts import prepare_expert_lists, quantized_experts_moe, stack_experts
from pagedserve.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV2Layer", "route_deepseek"]

#: transformers' DeepseekV2RMSNorm default: the q/kv latent norms do not take rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Layer:
    """One layer's weights.  q (direct query) or q_a, q_a_norm, q_b (low-rank query);
    kv_a [kv_lora_rank + rope, hidden], kv_a_norm, kv_b_proj as w_uk [heads, nope,
    kv_lora_rank] and w_uv [heads, kv_lora_rank, v] (float), o; a dense layer has
    gate_up/down only, a MoE layer router (float32 [E, hidden]), w13 [E, 2 * I, hidden],
    w2 [E, hidden, I] (or, quantized, lists of E weights) and the
    shared experts as gate_up/down.  q_order / kv_a_order (int64 over the output columns)
    when a quantized q / kv_a kept its stored rows: the rotate-half order, applied at run time."""

    __slots__ = (
        "input_norm",
        "post_norm",
        "q",
        "q_a",
        "q_a_norm",
        "q_b",
        "kv_a",
        "kv_a_norm",
        "w_uk",
        "w_uv",
        "o",
        "router",
        "w13",
        "w2",
        "gate_up",
        "down",
        "q_order",
        "kv_a_order",
    )


def route_deepseek(
    h: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int | None,
    topk_group: int | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden], router float32 [E, hidden] -> (weights float32 [T, top_k], ids int64
    [T, top_k]): softmax scores, top-k over all experts (greedy) or over the experts of
    each token's ``topk_group`` best groups (a group scores its best expert), times
    ``scaling``; never renormalised (transformers' DeepseekV2TopkRouter)."""
    scores = torch.softmax(torch.nn.functional.linear(h.float(), router), dim=-1)
    if method == "group_limited_greedy":
        t, e = scores.shape
        group_scores = scores.view(t, n_group, e // n_group).amax(dim=-1)
        group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        scores = scores.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights * scaling, ids


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    layer_class = DeepseekV2Layer
    #: Whether the checkpoint's rope rows pair adjacent dimensions (reordered at load).
    rope_interleaved = True
    linear_fields = ("q", "q_a", "q_b", "kv_a", "o", "gate_up", "down")
    #: Latent attention reads unscaled cache rows only (no row scales, no per-layer scales).
    row_scaled_kv = False

    @classmethod
    def kv_cache_heads(cls, hf: dict[str, Any]) -> int:
        """One latent vector per token, shared by every head (and every rank)."""
        return 1

    @classmethod
    def kv_head_dim(cls, hf: dict[str, Any]) -> int:
        """Half the latent vector (kv_lora_rank + qk_rope_head_dim, rounded up): the key
        tensor holds the first half, the value tensor the second."""
        return -(-(int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])) // 2)

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        name = cfg.architecture

        def refuse(what: str) -> None:
            raise ValueError(f"{name}: {what} is not supported")

        kv_heads = hf.get("num_key_value_heads") or cfg.num_heads
        if kv_heads != cfg.num_heads:
            refuse(f"num_key_value_heads={kv_heads} != num_attention_heads={cfg.num_heads}")
        if hf.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {hf.get('hidden_act')!r} (silu)")
        if hf.get("mlp_bias"):
            refuse("mlp_bias")
        if hf.get("attention_bias"):
            refuse("attention_bias")
        # Original DeepSeek code makes only every moe_layer_freq-th layer sparse and may
        # renormalise; transformers (the reference here) does neither.
        if int(hf.get("moe_layer_freq", 1) or 1) != 1:
            refuse(f"moe_layer_freq={hf['moe_layer_freq']} (1)")
        if int(hf.get("n_shared_experts") or 0) < 1:
            refuse("n_shared_experts=0 (at least one shared expert)")
        cls.check_routing(hf, refuse)

    @classmethod
    def check_routing(cls, hf: dict[str, Any], refuse) -> None:
        """Refuse (``refuse(what)``) router settings this family does not implement."""
        if hf.get("norm_topk_prob") and int(hf.get("num_experts_per_tok") or 1) > 1:
            refuse("norm_topk_prob=true")
        method = hf.get("topk_method", "greedy") or "greedy"
        if method not in _TOPK_METHODS:
            refuse(f"topk_method {method!r} (supported: {', '.join(_TOPK_METHODS)})")
        if method == "group_limited_greedy":
            n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
            if not n_group or not topk_group or int(hf["n_routed_experts"]) % int(n_group):
                refuse(f"group_limited_greedy with n_group={n_group}, topk_group={topk_group}")
        if hf.get("scoring_func", "softmax") != "softmax":
            refuse(f"scoring_func {hf['scoring_func']!r} (softmax)")

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        hf = cfg.hf_config
        self.nope, self.rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.kv_rank = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        self.q_rank = hf.get("q_lora_rank")
        super().__init__(cfg, *args, **kwargs)
        self.first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
        self.num_experts = int(hf["n_routed_experts"])
        self.top_k = int(hf["num_experts_per_tok"])
        self.topk_method = hf.get("topk_method", "greedy") or "greedy"
        self.n_group, self.topk_group = hf.get("n_group"), hf.get("topk_group")
        self.routed_scaling = float(hf.get("routed_scaling_factor", 1.0))

    def attention_scale(self) -> float:
        scale = (self.nope + self.rope_dim) ** -0.5
        scaling = self.cfg.rope_scaling or {}
        m_all = scaling.get("mscale_all_dim", 0)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default" and m_all and scaling["factor"] > 1:
            m = 0.1 * m_all * math.log(scaling["factor"]) + 1.0
            scale *= m * m
        return scale

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding:
        cfg = self.cfg
        return RotaryEmbedding(self.rope_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling, devices)

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        a = "self_attn."
        names = {"input_layernorm.weight", "post_attention_layernorm.weight", a + "o_proj.weight"}
        names |= {a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight"}
        if self.q_rank is None:
            names.add(a + "q_proj.weight")
        else:
            names |= {a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
        mlp = ("gate_proj", "up_proj", "down_proj")
        if layer < self.first_dense:
            return frozenset(names | {f"mlp.{p}.weight" for p in mlp})
        names.add("mlp.gate.weight")
        names |= {f"mlp.experts.{e}.{p}.weight" for e in range(self.num_experts) for p in mlp}
        return frozenset(names | {f"mlp.shared_experts.{p}.weight" for p in mlp})

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's heads of q_proj / q_b_proj (nope + rope rows each) and kv_b_proj
        (nope + v rows each), their v columns of o_proj; experts as the base splits them;
        the latent projections, norms and router whole."""
        kind, leaf = local.rsplit(".", 2)[-2:]
        r, heads = self.parallel.tp_rank, self.num_heads
        per_head = {"q_proj": self.nope + self.rope_dim, "q_b_proj": self.nope + self.rope_dim}
        per_head["kv_b_proj"] = self.nope + self.v_dim
        if kind in per_head:
            rows = heads * per_head[kind]
            return t[r * rows : (r + 1) * rows]
        if kind == "o_proj" and leaf == "weight":
            cols = heads * self.v_dim
            return t[:, r * cols : (r + 1) * cols]
        if kind in ("q_a_proj", "kv_a_proj_with_mqa"):
            return t
        return super().shard_layer_tensor(local, t)

    def _rope_rows_rotate_half(self, t: torch.Tensor, heads: int, head: int) -> torch.Tensor:
        """Rows of ``heads`` blocks of ``head`` rows whose last qk_rope_head_dim rows are a
        rope part: those reordered evens then odds (interleaved -> rotate-half)."""
        r, start = self.rope_dim, head - self.rope_dim
        order = torch.cat([torch.arange(start), start + torch.arange(0, r, 2), start + torch.arange(1, r, 2)])
        return t[(torch.arange(heads)[:, None] * head + order).reshape(-1)]

    def _rope_ordered(self, t: Any, heads: int, head: int, device: torch.device) -> tuple[Any, torch.Tensor | None]:
        """A float weight with its rope rows in rotate-half order, or a quantized one as
        stored with that order for its output columns (int64 on ``device``)."""
        if not self.rope_interleaved:
            return t, None
        if isinstance(t, QuantizedWeight):
            return t, self._rope_rows_rotate_half(torch.arange(t.out_features), heads, head).to(device)
        return self._rope_rows_rotate_half(t, heads, head), None

    def finish_layer(self, layer: DeepseekV2Layer, w: dict[str, Any], param) -> None:
        a, heads = "self_attn.", self.num_heads
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        dev = layer.input_norm.device
        layer.q = layer.q_a = layer.q_a_norm = layer.q_b = None
        head = self.nope + self.rope_dim
        if self.q_rank is None:
            q, layer.q_order = self._rope_ordered(w[a + "q_proj.weight"], heads, head, dev)
            layer.q = param(q)
        else:
            layer.q_a = param(w[a + "q_a_proj.weight"])
            layer.q_a_norm = param(w[a + "q_a_layernorm.weight"])
            q_b, layer.q_order = self._rope_ordered(w[a + "q_b_proj.weight"], heads, head, dev)
            layer.q_b = param(q_b)
        kv_a, layer.kv_a_order = self._rope_ordered(
            w[a + "kv_a_proj_with_mqa.weight"], 1, self.kv_rank + self.rope_dim, dev
        )
        layer.kv_a = param(kv_a)
        layer.kv_a_norm = param(w[a + "kv_a_layernorm.weight"])
        kv_b = w[a + "kv_b_proj.weight"]
        if isinstance(kv_b, QuantizedWeight):
            kv_b = kv_b.dequantize()
        kv_b = kv_b.float().view(heads, self.nope + self.v_dim, self.kv_rank)
        layer.w_uk = param(kv_b[:, : self.nope].contiguous())
        layer.w_uv = param(kv_b[:, self.nope :].transpose(1, 2).contiguous())
        layer.o = param(w[a + "o_proj.weight"])
        layer.router = layer.w13 = layer.w2 = None
        m = "mlp." if "mlp.gate.weight" not in w else "mlp.shared_experts."
        layer.gate_up = param(fuse([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        layer.down = param(w[m + "down_proj.weight"])
        if "mlp.gate.weight" in w:
            self._finish_experts(layer, w, param)

    def _finish_experts(self, layer: DeepseekV2Layer, w: dict[str, Any], param) -> None:
        router = w["mlp.gate.weight"]
        if isinstance(router, QuantizedWeight):
            router = router.dequantize()
        # Routing stays float32 whatever the model dtype, as transformers keeps it.
        layer.router = router.to(device=layer.input_norm.device, dtype=torch.float32)
        ex = [f"mlp.experts.{e}." for e in range(self.num_experts)]
        gate_up = [[w[e + "gate_proj.weight"], w[e + "up_proj.weight"]] for e in ex]
        down = [w[e + "down_proj.weight"] for e in ex]
        layer.w13, layer.w2 = stack_experts(gate_up, down, param, fuse, self.cfg.architecture)

    def prepare_linear_weights(self) -> None:
        """Dense weights as every family; the stacked experts through ``prepare_moe_weights``,
        quantized experts each in their prepared form."""
        super().prepare_linear_weights()
        for pl in self.placements:
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                if isinstance(layer.w13, torch.Tensor):
                    layer.w13, layer.w2 = pl.ops.prepare_moe_weights(layer.w13, layer.w2)
                elif isinstance(layer.w13, list):
                    layer.w13, layer.w2 = prepare_expert_lists(pl.ops, layer.w13, layer.w2)

    def attention(
        self, ops, placement: int, layer: DeepseekV2Layer, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """MLA over the latent cache: h [n, hidden] -> [n, heads * v_head_dim]."""
        n, heads, rank, rope = h.shape[0], self.num_heads, self.kv_rank, self.rope_dim
        if layer.q is not None:
            q = linear(ops, h, layer.q)
        else:
            q = linear(ops, ops.rms_norm(linear(ops, h, layer.q_a), layer.q_a_norm, _LATENT_NORM_EPS), layer.q_b)
        kv_a = linear(ops, h, layer.kv_a)
        if layer.q_order is not None:
            q = q.index_select(-1, layer.q_order)
        if layer.kv_a_order is not None:
            kv_a = kv_a.index_select(-1, layer.kv_a_order)
        q_nope, q_pe = q.view(n, heads, self.nope + rope).split([self.nope, rope], dim=-1)
        latent, k_pe = kv_a.split([rank, rope], dim=-1)
        latent = ops.rms_norm(latent.contiguous(), layer.kv_a_norm, _LATENT_NORM_EPS)
        q_pe, k_pe = self.rope(ops, placement, meta.positions, q_pe.contiguous(), k_pe.reshape(n, 1, rope))
        # The cached vector [latent | k_rope], padded to the two halves of the cache pair.
        half = self.cfg.head_dim
        parts = [latent, k_pe.reshape(n, rope)]
        if 2 * half > rank + rope:
            parts.append(latent.new_zeros(n, 2 * half - rank - rope))
        entry = torch.cat(parts, dim=-1).view(n, 2, 1, half)
        k_cache, v_cache = kv_cache
        ops.reshape_and_cache(entry[:, 0].contiguous(), entry[:, 1].contiguous(), k_cache, v_cache, meta.slot_mapping)
        # Absorb W_UK: [heads, n, nope] x [heads, nope, rank] -> the query over the latent.
        q_latent = torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)
        o = ops.mla_paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.attn.scale, rank
        )
        # Each head's W_UV: [heads, n, rank] x [heads, rank, v].
        return torch.bmm(o.transpose(0, 1), layer.w_uv).transpose(0, 1).reshape(n, heads * self.v_dim)

    def route(self, h: torch.Tensor, layer: DeepseekV2Layer) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE layer's (weights float32 [T, top_k], expert ids int64 [T, top_k])."""
        return route_deepseek(
            h, layer.router, self.top_k, self.topk_method, self.n_group, self.topk_group, self.routed_scaling
        )

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: DeepseekV2Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
        h = linear(ops, self.attention(ops, placement, layer, h, kv_cache, meta), layer.o)
        h, residual = ops.fused_add_rms_norm(self.parallel.all_reduce(h), residual, layer.post_norm, eps)
        out = gated_mlp(ops, h, layer.gate_up, layer.down)
        if layer.router is not None:
            weights, ids = self.route(h, layer)
            if isinstance(layer.w13, list):
                out = out + quantized_experts_moe(ops, h, layer.w13, layer.w2, weights, ids)
            else:
                out = out + ops.fused_moe(h, layer.w13, layer.w2, weights, ids, "silu")
        return self.parallel.all_reduce(out), residual
