"""Nemotron-H (``NemotronHForCausalLM``): one mixer per layer, each with a pre-norm and a
residual -- Mamba 2 (``M``), attention without a rotary embedding (``*``) or a
non-gated squared-ReLU MLP (``-``), as ``layers_block_type`` or
``hybrid_override_pattern`` lists them.  The Mamba 2 mixer is Granite 4's
(:class:`~pagedserve.models.mamba2.Mamba2Mixer`); the checkpoint's
``backbone.*`` names are read as the Llama layout (pagedserve.loader.hf_checkpoint).
MoE layers (``E``, Nemotron 3) are refused by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.granite_hybrid import _json_float
from pagedserve.models.layers import add_rms_norm, block_types, fuse, layer_windows, linear, paged_attention, qkv_split
from pagedserve.models.mamba2 import Mamba2Mixer
from pagedserve.models.recurrent import StateLayout

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["NemotronHForCausalLM", "NemotronHLayer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class NemotronHLayer:
    """One layer: ``kind`` (linear_attention, full_attention or mlp), its norm [hidden],
    and its mixer's weights (Mamba 2 as GraniteHybridLayer; qkv, o; up, down)."""

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
    )


class NemotronHForCausalLM(Mamba2Mixer, DecoderForCausalLM):
    layer_class = NemotronHLayer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "up", "down")
    tensor_parallel = False

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
        unknown = sorted(set(blocks) - {"linear_attention", "full_attention", "mlp"})
        if unknown:
            raise ValueError(f"{cfg.architecture}: layer kinds {unknown} are not supported (mamba, attention, mlp)")
        if hf.get("mlp_hidden_act", "relu2") != "relu2" or hf.get("mlp_bias") or hf.get("use_bias"):
            raise ValueError(f"{cfg.architecture}: only bias-free relu2 MLPs are supported")
        if hf.get("mamba_proj_bias") or hf.get("mamba_hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: only bias-free Mamba projections with silu are supported")
        if int(hf["mamba_num_heads"]) % int(hf.get("n_groups", 1)):
            raise ValueError(f"{cfg.architecture}: mamba_num_heads must be a multiple of n_groups")

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.windows = layer_windows(hf, cfg.num_layers)
        self.kinds = block_types(hf)
        self.eps = self.mamba_eps = float(hf.get("layer_norm_epsilon", cfg.rms_norm_eps))
        self.heads, self.head_dim = int(hf["mamba_num_heads"]), int(hf["mamba_head_dim"])
        self.groups, self.d_state = int(hf.get("n_groups", 1)), int(hf["ssm_state_size"])
        self.width = int(hf["conv_kernel"])
        self.d_inner = self.heads * self.head_dim
        self.conv_dim = self.d_inner + 2 * self.groups * self.d_state
        self.chunk = int(hf.get("chunk_size", 128))
        limit = hf.get("time_step_limit") or (0.0, math.inf)
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.state = StateLayout(
            [(self.conv_dim, self.width - 1), (self.heads, self.head_dim, self.d_state)], self.dtype
        )

    def state_bytes(self, cache_dtype: torch.dtype) -> int:
        """Bytes of one request's state in one Mamba layer (what a state group's pages must
        hold), stored in the model's dtype whatever the KV cache's ``cache_dtype``."""
        return self.state.nbytes(cache_dtype)

    # -- weights ------------------------------------------------------------------------------
    def layer_weight_names(self, layer: int) -> frozenset[str]:
        kind = self.kinds[layer]
        names = {"norm.weight"}
        if kind == "full_attention":
            names |= {f"mixer.{p}.weight" for p in (*_ATTN, "o_proj")}
        elif kind == "mlp":
            names |= {"mixer.up_proj.weight", "mixer.down_proj.weight"}
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
            return self._mamba(ops, layer, h, kv_cache, meta), residual
        if layer.kind == "full_attention":
            q, k, v = qkv_split(linear(ops, h, layer.qkv), self.attn)
            return linear(ops, paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale), layer.o), residual
        return linear(ops, torch.relu(linear(ops, h, layer.up)).square(), layer.down), residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.eps)
        return h
