"""Mixture-of-experts families: Mixtral, Qwen2-MoE (with a gated shared expert) and
Qwen3-MoE -- Llama/Qwen attention with a routed MLP that runs the ``fused_moe`` op.

Expert weights are stacked at load: ``w13`` [E, 2 * I, hidden] (each expert's gate and
up rows), ``w2`` [E, hidden, I]; quantized experts stay lists of one quantized weight
per expert and run through :mod:`pagedserve.models.quantized_experts`, the quantized
linear ops grouped as ``fused_moe`` groups them.  Routing (softmax, top-k, optional renormalisation)
is plain torch on the router logits.

A device map by tensor class (``experts=cpu,*=cuda``, :meth:`_MoEForCausalLM.place_experts`)
keeps every layer's routed experts (w13, w2) on another placement: the router, the
shared expert and attention stay with the layer, and each MoE layer moves its hidden
states and routing to the experts' device, runs that placement's ``fused_moe`` there and
moves the result back.

Tensor parallelism shards every expert's intermediate dimension (each rank keeps its
rows of each expert's gate and up and its columns of each down, so the ``fused_moe``
op runs unchanged on smaller experts) and the shared expert the same way; the router
and the shared expert's gate are replicated.  Each rank's output is a partial sum over
the intermediate dimension, completed by the decoder layer's all-reduce after the MLP.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import LayerPlacement, fuse, gated_mlp, linear, route_topk
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.quantized_experts import prepare_expert_lists, quantized_experts_moe, stack_experts

__all__ = ["MoELayer", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class MoELayer:
    """One decoder layer: attention as in Llama; a sparse layer holds router [E, hidden],
    w13, w2 and, for Qwen2-MoE, the shared expert (gate_up, down) and its sigmoid gate
    [1, hidden]; a dense layer (``mlp_only_layers``) only gate_up and down.  Quantized
    experts: w13 and w2 are lists of E quantized weights ([2 * I, hidden], [hidden, I])."""

    __slots__ = (
        "input_norm",
        "post_norm",
        "qkv",
        "qkv_bias",
        "q_norm",
        "k_norm",
        "o",
        "router",
        "w13",
        "w2",
        "shared_gate",
        "gate_up",
        "down",
    )


class _MoEForCausalLM(LlamaForCausalLM):
    """What the three families share; subclasses name the checkpoint's MoE tensors."""

    layer_class = MoELayer
    linear_fields = ("qkv", "o", "gate_up", "down")
    #: checkpoint prefix of the MoE block, and expert tensor names for (gate, up, down).
    moe_prefix: ClassVar[str] = "mlp."
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: ClassVar[bool] = False

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.num_experts = int(hf.get("num_local_experts") or hf.get("num_experts"))
        self.top_k = int(hf["num_experts_per_tok"])
        self.renormalize = bool(hf.get("norm_topk_prob", True))
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        self.sparse = [i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers)]
        self.activation = hf.get("hidden_act", "silu")
        #: Where the routed experts live and run when a device map places them apart
        #: (place_experts), else None: with their layer.
        self.expert_placement: LayerPlacement | None = None

    @classmethod
    def places_experts(cls, hf: dict) -> bool:
        """Whether config.json ``hf`` has routed experts a device map can place."""
        return bool(hf.get("num_local_experts") or hf.get("num_experts"))

    def place_experts(self, placement: LayerPlacement) -> None:
        """Keep every layer's routed experts on ``placement`` (called before loading)."""
        if not any(self.sparse):
            raise ValueError(
                f"device_map places the routed experts, but no layer of this {self.cfg.architecture} checkpoint "
                "has any (mlp_only_layers / decoder_sparse_step make every layer dense); drop 'experts=' from the map"
            )
        self.expert_placement = placement

    def _layer_placement(self, index: int) -> LayerPlacement:
        return next(pl for pl in self.placements if pl.start <= index < pl.end)

    def placement_weight_bytes(self) -> list[int]:
        """As the base, less the routed experts where a device map keeps them elsewhere."""
        out = super().placement_weight_bytes()
        if self.expert_placement is None:
            return out
        for i, pl in enumerate(self.placements):
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                out[i] -= sum(t.nbytes for t in (layer.w13, layer.w2) if isinstance(t, torch.Tensor))
        return out

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        act = cfg.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {act!r} is not supported for experts (silu)")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"}
        names |= {f"self_attn.{p}.weight" for p in _ATTN}
        if self.cfg.attention_bias:
            names |= {f"self_attn.{p}.bias" for p in _ATTN}
        if self.qk_norm:
            names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        if not self.sparse[layer]:
            return frozenset(names | {f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})
        m = self.moe_prefix
        names.add(m + "gate.weight")
        names |= {f"{m}experts.{e}.{p}.weight" for e in range(self.num_experts) for p in self.expert_names}
        if self.shared_expert:
            names |= {f"{m}shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            names.add(m + "shared_expert_gate.weight")
        return frozenset(names)

    def finish_layer(self, layer: MoELayer, w: dict[str, Any], param) -> None:
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        a = "self_attn."
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.qkv_bias = param(torch.cat([w[a + p + ".bias"] for p in _ATTN])) if self.cfg.attention_bias else None
        layer.q_norm = param(w[a + "q_norm.weight"]) if self.qk_norm else None
        layer.k_norm = param(w[a + "k_norm.weight"]) if self.qk_norm else None
        layer.o = param(w[a + "o_proj.weight"])
        layer.router = layer.w13 = layer.w2 = layer.shared_gate = layer.gate_up = layer.down = None
        m = self.moe_prefix
        if "mlp.gate_proj.weight" in w and m + "gate.weight" not in w:  # a dense layer
            layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
            layer.down = param(w["mlp.down_proj.weight"])
            return
        g, u, d = self.expert_names
        experts = range(self.num_experts)
        layer.router = param(w[m + "gate.weight"])
        gate_up = [[w[f"{m}experts.{e}.{g}.weight"], w[f"{m}experts.{e}.{u}.weight"]] for e in experts]
        down = [w[f"{m}experts.{e}.{d}.weight"] for e in experts]
        if self.expert_placement is not None:
            device = self.expert_placement.device
            param = lambda t: self._param(t, device)  # noqa: E731 (the experts' device)
        layer.w13, layer.w2 = stack_experts(gate_up, down, param, fuse, f"{self.cfg.architecture} ({g}, {u}, {d})")
        if self.shared_expert:
            s = m + "shared_expert."
            layer.gate_up = param(fuse([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]]))
            layer.down = param(w[s + "down_proj.weight"])
            layer.shared_gate = param(w[m + "shared_expert_gate.weight"])

    def prepare_linear_weights(self) -> None:
        """Dense weights as every family; the stacked experts through each placement's
        ``prepare_moe_weights`` (e.g. the CPU's bf16 packing for its native kernel);
        quantized experts each take their prepared form (e.g. repacked GGUF blocks)."""
        super().prepare_linear_weights()
        for pl in self.placements:
            ops = (self.expert_placement or pl).ops
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                if isinstance(layer.w13, torch.Tensor):
                    layer.w13, layer.w2 = ops.prepare_moe_weights(layer.w13, layer.w2)
                elif isinstance(layer.w13, list):
                    layer.w13, layer.w2 = prepare_expert_lists(ops, layer.w13, layer.w2)

    def mlp_forward(self, ops, index: int, layer: MoELayer, h: torch.Tensor) -> torch.Tensor:
        if layer.w13 is None:
            return gated_mlp(ops, h, layer.gate_up, layer.down)
        weights, ids = route_topk(linear(ops, h, layer.router), self.top_k, self.renormalize)
        if isinstance(layer.w13, list):
            out = quantized_experts_moe(ops, h, layer.w13, layer.w2, weights, ids)
        elif self.expert_placement is not None:  # only the activations and the routing cross
            ep = self.expert_placement
            out = ep.ops.fused_moe(ep.move(h), layer.w13, layer.w2, ep.move(weights), ep.move(ids), "silu")
            out = self._layer_placement(index).move(out)
        else:
            out = ops.fused_moe(h, layer.w13, layer.w2, weights, ids, "silu")
        if layer.shared_gate is not None:
            gate = torch.sigmoid(linear(ops, h, layer.shared_gate))
            out = out + gate * gated_mlp(ops, h, layer.gate_up, layer.down)
        return out


class MixtralForCausalLM(_MoEForCausalLM):
    """Mixtral: Mistral attention, top-k of ``num_local_experts`` renormalised."""

    moe_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.renormalize = True


class Qwen2MoeForCausalLM(_MoEForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v biases), routed experts plus a shared expert
    scaled by a sigmoid gate; ``norm_topk_prob`` decides renormalisation."""

    default_attention_bias = True
    shared_expert = True


class Qwen3MoeForCausalLM(_MoEForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), routed experts, no shared one.

    Also the language model of Qwen3-VL-MoE (``text_config.model_type`` qwen3_vl_moe_text),
    whose checkpoints fuse each layer's experts into ``mlp.experts.gate_up_proj`` and
    ``mlp.experts.down_proj`` -- [E, hidden, 2 * I] (gate, then up) and [E, I, hidden] as
    Qwen publishes them, or [E, 2 * I, hidden] and [E, hidden, I] as transformers 5 holds
    and saves them (told apart by shape as transformers does: its layout when it fits)
    -- and always renormalise the top-k routing weights."""

    qk_norm = True

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.fused_experts = cfg.hf_config.get("model_type") == "qwen3_vl_moe_text"
        if self.fused_experts:
            self.renormalize = True
            if self.parallel.tp_size > 1:
                raise ValueError(
                    "Qwen3-VL-MoE's fused expert tensors are not split for tensor parallelism yet; "
                    "use tensor_parallel_size=1"
                )

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = super().layer_weight_names(layer)
        if not self.fused_experts or not self.sparse[layer]:
            return names
        m = self.moe_prefix + "experts."
        fused = {m + "gate_up_proj", m + "down_proj"}
        return frozenset({n for n in names if not n.startswith(m)} | fused)

    def finish_layer(self, layer: MoELayer, w: dict[str, Any], param) -> None:
        m = self.moe_prefix + "experts."
        if self.fused_experts and m + "gate_up_proj" in w:
            gate_up, down = w.pop(m + "gate_up_proj"), w.pop(m + "down_proj")
            n, inter, hidden = self.num_experts, int(self.cfg.hf_config["moe_intermediate_size"]), self.cfg.hidden_size
            if tuple(gate_up.shape) != (n, 2 * inter, hidden):
                gate_up = gate_up.transpose(1, 2)  # as published: [E, hidden, 2 * I]
            if tuple(down.shape) != (n, hidden, inter):
                down = down.transpose(1, 2)  # as published: [E, I, hidden]
            if tuple(gate_up.shape) != (n, 2 * inter, hidden) or tuple(down.shape) != (n, hidden, inter):
                raise ValueError(
                    f"Qwen3-VL-MoE's fused experts have shapes {list(gate_up.shape)} / {list(down.shape)}; expected "
                    f"[{n}, {hidden}, {2 * inter}] / [{n}, {inter}, {hidden}] or their transposes"
                )
            for e in range(n):  # each expert's [out, in] weights
                w[f"{m}{e}.gate_proj.weight"] = gate_up[e, :inter]
                w[f"{m}{e}.up_proj.weight"] = gate_up[e, inter:]
                w[f"{m}{e}.down_proj.weight"] = down[e]
        super().finish_layer(layer, w, param)
