"""Nemotron-H (``NemotronHForCausalLM``): one mixer per layer, each with a pre-norm and a
residual -- Mamba 2 (``M``), attention without a rotary embedding (``*``), a
non-gated squared-ReLU MLP (``-``) or a mixture of such MLPs (``E``, Nemotron 3), as
``layers_block_type`` or ``hybrid_override_pattern`` lists them.  The Mamba 2 mixer is
Granite 4's (:class:`~pagedserve.models.mamba2.Mamba2Mixer`); the checkpoint's
``backbone.*`` names are read as the Llama layout (pagedserve.loader.hf_checkpoint).

MoE layers: DeepSeek-V3's routing (sigmoid scores plus a score-correction bias choose
``topk_group`` of ``n_group`` groups, then the top ``num_experts_per_tok`` experts;
weights the plain scores, renormalised with ``norm_topk_prob``, times
``routed_scaling_factor``: ``deepseek_v3.route_sigmoid_groups``); each expert
``down(relu(up(x))^2)``, optionally inside a latent projection (``moe_latent_size``:
``fc1_latent_proj`` before the experts, ``fc2_latent_proj`` after), plus a shared
squared-ReLU MLP.  The experts run grouped by expert (one pair of GEMMs per active
expert: ``fused_moe`` has no non-gated activation).

Tensor parallelism splits the Mamba 2 layers by heads and groups
(:mod:`pagedserve.models.mamba2`), attention by heads, the MLP by its intermediate rows;
each mixer's output is summed over the ranks.  A MoE layer splits every routed expert
and the shared MLP by intermediate rows; every rank routes identically from the whole
``h`` (router, score-correction bias and group choice are replicated) and keeps the
latent projections whole: ``fc2_latent_proj`` applied to the rank's partial latent sum
is linear, so the layer's one all-reduce (of the shared MLP's partial plus the experts'
partial) is exact.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.deepseek_v3 import route_sigmoid_groups
from pagedserve.models.granite_hybrid import _json_float
from pagedserve.models.layers import add_rms_norm, block_types, fuse, layer_windows, linear, paged_attention, qkv_split
from pagedserve.models.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["NemotronHForCausalLM", "NemotronHLayer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class NemotronHLayer:
    """One layer: ``kind`` (linear_attention, full_attention, mlp or moe), its norm
    [hidden], and its mixer's weights (Mamba 2 as GraniteHybridLayer; qkv, o; up, down;
    for moe: router float32 [E, hidden], router_bias float32 [E], experts_up [E, I, d],
    experts_down [E, d, I] with d the latent size or hidden, latent_in [d, hidden] and
    latent_out [hidden, d] or None, and the shared MLP's up, down)."""

    __slots__ = (
        "kind",
        "mamba",
        "norm",
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
        "up",
        "down",
        "router",
        "router_bias",
        "experts_up",
        "experts_down",
        "latent_in",
        "latent_out",
    )


class NemotronHForCausalLM(Mamba2Mixer, DecoderForCausalLM):
    layer_class = NemotronHLayer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "up", "down")

    @classmethod
    def kv_head_dim(cls, hf: dict) -> int:
        return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        blocks = block_types(hf)
        if blocks is None:
            raise ValueError(
                f"{cfg.architecture}: the config has neither layers_block_type nor hybrid_override_pattern"
            )
        unknown = sorted(set(blocks) - {"linear_attention", "full_attention", "mlp", "moe"})
        if unknown:
            raise ValueError(
                f"{cfg.architecture}: layer kinds {unknown} are not supported (mamba, attention, mlp, moe)"
            )
        if "moe" in blocks:
            experts, top_k = int(hf["n_routed_experts"]), int(hf["num_experts_per_tok"])
            n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
            if experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
                raise ValueError(
                    f"{cfg.architecture}: n_group={n_group}, topk_group={topk_group} over {experts} experts "
                    "(groups of at least two experts, topk_group of them at most)"
                )
            if top_k > topk_group * (experts // n_group):
                raise ValueError(f"{cfg.architecture}: num_experts_per_tok={top_k} beyond topk_group groups' experts")
        if hf.get("mlp_hidden_act", "relu2") != "relu2" or hf.get("mlp_bias") or hf.get("use_bias"):
            raise ValueError(f"{cfg.architecture}: only bias-free relu2 MLPs are supported")
        if hf.get("mamba_proj_bias") or hf.get("mamba_hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: only bias-free Mamba projections with silu are supported")
        if int(hf["mamba_num_heads"]) % int(hf.get("n_groups", 1)):
            raise ValueError(f"{cfg.architecture}: mamba_num_heads must be a multiple of n_groups")

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        heads, groups = int(hf["mamba_num_heads"]), int(hf.get("n_groups", 1))
        why = cls.mamba_refusal(heads, groups, tp, ("mamba_num_heads", "n_groups"))
        if why is None and "moe" in block_types(hf):  # experts and shared MLP split by intermediate rows
            for key in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
                size = int(hf.get(key) or 0)
                if size % tp:
                    return f"it must divide the MoE layers' {key} ({size})"
        return why

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.kinds = block_types(hf)
        self.eps = self.mamba_eps = float(hf.get("layer_norm_epsilon", cfg.rms_norm_eps))
        heads, groups = int(hf["mamba_num_heads"]), int(hf.get("n_groups", 1))
        self.set_mamba_shapes(
            heads, int(hf["mamba_head_dim"]), groups, int(hf["ssm_state_size"]), int(hf["conv_kernel"])
        )
        self.chunk = int(hf.get("chunk_size", 128))
        limit = hf.get("time_step_limit") or (0.0, math.inf)
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.num_experts = int(hf.get("n_routed_experts") or 0)
        self.top_k = int(hf.get("num_experts_per_tok") or 0)
        self.n_group, self.topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        self.normalize = bool(hf.get("norm_topk_prob", True))
        self.routed_scaling = float(hf.get("routed_scaling_factor", 1.0))
        self.latent = hf.get("moe_latent_size") is not None

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """A Mamba 2 mixer's tensors by heads and groups; attention and MLP as every family."""
        parts = local.split(".")
        if parts[0] == "mixer":
            out = self.shard_mamba_tensor(parts[1], local, t)
            if out is not None:
                return out
        return super().shard_layer_tensor(local, t)

    # -- weights ------------------------------------------------------------------------------
    def layer_weight_names(self, layer: int) -> frozenset[str]:
        kind = self.kinds[layer]
        names = {"norm.weight"}
        if kind == "full_attention":
            names |= {f"mixer.{p}.weight" for p in (*_ATTN, "o_proj")}
        elif kind == "mlp":
            names |= {"mixer.up_proj.weight", "mixer.down_proj.weight"}
        elif kind == "moe":
            m = "mixer."
            names |= {m + "gate.weight", m + "gate.e_score_correction_bias"}
            names |= {m + "shared_experts.up_proj.weight", m + "shared_experts.down_proj.weight"}
            names |= {f"{m}experts.{e}.{p}.weight" for e in range(self.num_experts) for p in ("up_proj", "down_proj")}
            if self.latent:
                names |= {m + "fc1_latent_proj.weight", m + "fc2_latent_proj.weight"}
        else:
            m = "mixer."
            names |= {m + n for n in ("dt_bias", "A_log", "D", "conv1d.weight", "in_proj.weight", "norm.weight")}
            names.add(m + "out_proj.weight")
            if self.cfg.hf_config.get("use_conv_bias", True):
                names.add(m + "conv1d.bias")
        return frozenset(names)

    def finish_layer(self, layer: NemotronHLayer, w: dict[str, Any], param) -> None:
        for name in NemotronHLayer.__slots__:
            setattr(layer, name, None)
        layer.norm = param(w["norm.weight"])
        m = "mixer."
        if m + "A_log" in w:
            layer.kind, layer.mamba = "linear_attention", True
            layer.in_proj = param(w[m + "in_proj.weight"])
            layer.conv = param(w[m + "conv1d.weight"].reshape(self.conv_dim, self.width))
            layer.conv_bias = param(w[m + "conv1d.bias"]) if m + "conv1d.bias" in w else None
            layer.dt_bias = param(w[m + "dt_bias"]).float()
            layer.A = -param(w[m + "A_log"]).float().exp()
            layer.D = param(w[m + "D"]).float()
            layer.out_norm = param(w[m + "norm.weight"])
            layer.out_proj = param(w[m + "out_proj.weight"])
        elif m + "q_proj.weight" in w:
            layer.kind, layer.mamba = "full_attention", False
            layer.qkv = param(fuse([w[m + p + ".weight"] for p in _ATTN]))
            layer.o = param(w[m + "o_proj.weight"])
        elif m + "gate.weight" in w:
            layer.kind, layer.mamba = "moe", False
            layer.router = w[m + "gate.weight"].to(device=layer.norm.device, dtype=torch.float32)
            layer.router_bias = w[m + "gate.e_score_correction_bias"].to(device=layer.norm.device, dtype=torch.float32)
            e = range(self.num_experts)
            layer.experts_up = param(torch.stack([w[f"{m}experts.{i}.up_proj.weight"] for i in e]))
            layer.experts_down = param(torch.stack([w[f"{m}experts.{i}.down_proj.weight"] for i in e]))
            layer.up = param(w[m + "shared_experts.up_proj.weight"])
            layer.down = param(w[m + "shared_experts.down_proj.weight"])
            if self.latent:
                layer.latent_in = param(w[m + "fc1_latent_proj.weight"])
                layer.latent_out = param(w[m + "fc2_latent_proj.weight"])
        else:
            layer.kind, layer.mamba = "mlp", False
            layer.up = param(w[m + "up_proj.weight"])
            layer.down = param(w[m + "down_proj.weight"])

    # -- forward ------------------------------------------------------------------------------
    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: NemotronHLayer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_rms_norm(ops, x, residual, layer.norm, self.eps)
        if layer.kind == "linear_attention":
            out = self._mamba(ops, layer, h, kv_cache, meta)
        elif layer.kind == "full_attention":
            q, k, v = qkv_split(linear(ops, h, layer.qkv), self.attn)
            out = linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o)
        else:
            out = linear(ops, torch.relu(linear(ops, h, layer.up)).square(), layer.down)
            if layer.kind == "moe":
                out = out + self._moe(ops, layer, h)
        return self.parallel.all_reduce(out), residual  # each mixer's last projection is row-parallel

    def _moe(self, ops, layer: NemotronHLayer, h: torch.Tensor) -> torch.Tensor:
        """The routed experts of a MoE layer, h [n, hidden] -> [n, hidden]: under tensor
        parallelism this rank's partial sum (its intermediate rows of every expert, through
        the whole ``fc2_latent_proj``), which the layer's all-reduce completes."""
        weights, ids = route_sigmoid_groups(
            h,
            layer.router,
            layer.router_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.normalize,
            self.routed_scaling,
        )
        x = h if layer.latent_in is None else linear(ops, h, layer.latent_in)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, k = torch.nonzero(ids == e, as_tuple=True)
            y = torch.relu(linear(ops, x[tok], layer.experts_up[e])).square()
            y = linear(ops, y, layer.experts_down[e])
            out.index_add_(0, tok, y.float() * weights[tok, k, None])
        out = out.to(h.dtype)
        return out if layer.latent_out is None else linear(ops, out, layer.latent_out)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.eps)
        return h
