"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also the layout of Kimi K2 and DeepSeek-R1):
DeepSeek-V2's multi-head latent attention (the latent cached, see
:mod:`pagedserve.models.deepseek_v2`) with V3's router, as transformers implements it.

Routing (transformers' DeepseekV3TopkRouter, DeepSeek's ``noaux_tc``): sigmoid scores of a
float32 router; for the choice only, each expert's score plus its
``e_score_correction_bias``; each of ``n_group`` groups scores the sum of its two best
biased scores, the ``topk_group`` best groups are kept, and the top ``num_experts_per_tok``
experts among them chosen; their weights are the unbiased sigmoid scores, renormalised to
sum to one when ``norm_topk_prob``, times ``routed_scaling_factor``.  Layers before
``first_k_dense_replace`` are dense; every later one is MoE with shared experts.

``rope_interleave`` (default true) says the rope rows pair adjacent dimensions, as V2's
do: they are reordered at load as for V2; false means rotate-half rows, kept as stored.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Layer
from pagedserve.quantization.base import QuantizedWeight

__all__ = ["DeepseekV3ForCausalLM", "DeepseekV3Layer", "route_sigmoid_groups"]


class DeepseekV3Layer(DeepseekV2Layer):
    """V2's layer plus the router's score-correction bias (float32 [E]) on MoE layers."""

    __slots__ = ("router_bias",)


def route_sigmoid_groups(
    h: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden], router float32 [E, hidden], bias float32 [E] -> (weights float32
    [T, top_k], ids int64 [T, top_k]), as the module docstring describes."""
    scores = torch.sigmoid(torch.nn.functional.linear(h.float(), router))
    choice = scores + bias
    t, e = scores.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_class = DeepseekV3Layer

    @classmethod
    def check_routing(cls, hf: dict[str, Any], refuse) -> None:
        scoring = hf.get("scoring_func") or "sigmoid"
        if scoring != "sigmoid":
            refuse(f"scoring_func {scoring!r} (sigmoid)")
        method = hf.get("topk_method") or "noaux_tc"
        if method != "noaux_tc":
            refuse(f"topk_method {method!r} (noaux_tc)")
        experts, n_group = int(hf["n_routed_experts"]), int(hf.get("n_group") or 1)
        topk_group = int(hf.get("topk_group") or 1)
        if experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
            refuse(
                f"n_group={n_group}, topk_group={topk_group} over {experts} experts (groups of at least two "
                "experts, topk_group of them at most)"
            )
        if int(hf["num_experts_per_tok"]) > topk_group * (experts // n_group):
            refuse(f"num_experts_per_tok={hf['num_experts_per_tok']} beyond the experts of topk_group groups")

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.rope_interleaved = bool(hf.get("rope_interleave", True))
        self.n_group, self.topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        self.normalize = bool(hf.get("norm_topk_prob", True))

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = super().layer_weight_names(layer)
        return names if layer < self.first_dense else names | {"mlp.gate.e_score_correction_bias"}

    def _finish_experts(self, layer: DeepseekV3Layer, w: dict[str, Any], param) -> None:
        super()._finish_experts(layer, w, param)
        bias = w["mlp.gate.e_score_correction_bias"]
        if isinstance(bias, QuantizedWeight):
            bias = bias.dequantize()
        layer.router_bias = bias.to(device=layer.router.device, dtype=torch.float32)

    def finish_layer(self, layer: DeepseekV3Layer, w: dict[str, Any], param) -> None:
        layer.router_bias = None
        super().finish_layer(layer, w, param)

    def route(self, h: torch.Tensor, layer: DeepseekV3Layer) -> tuple[torch.Tensor, torch.Tensor]:
        return route_sigmoid_groups(
            h,
            layer.router,
            layer.router_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.normalize,
            self.routed_scaling,
        )
