"""StarCoder2: LayerNorm (with bias) instead of RMSNorm, a non-gated GELU MLP
(``c_fc``, ``c_proj``), biases on every projection, and an optional sliding window on
every layer; composed from :mod:`pagedserve.models.layers` and the ``layer_norm`` and
``gelu`` ops.  Under tensor parallelism ``c_fc`` is column-parallel and ``c_proj`` and
``o_proj`` row-parallel; their biases are added once, after the all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import fuse, layer_windows, linear, paged_attention, qkv_split

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Starcoder2ForCausalLM", "Starcoder2Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")
_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class Starcoder2Layer:
    __slots__ = (
        "input_norm",
        "input_norm_bias",
        "post_norm",
        "post_norm_bias",
        "qkv",
        "qkv_bias",
        "o",
        "o_bias",
        "fc",
        "fc_bias",
        "proj",
        "proj_bias",
    )


class Starcoder2ForCausalLM(DecoderForCausalLM):
    layer_class = Starcoder2Layer
    linear_fields = ("qkv", "o", "fc", "proj")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        act = cfg.hf_config.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"Starcoder2ForCausalLM: hidden_act {act!r} is not supported ({', '.join(_ACTS)})")
        layer_windows(cfg.hf_config, cfg.num_layers)

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        self.eps = float(hf.get("norm_epsilon", 1e-5))
        self.bias = bool(hf.get("use_bias", True))
        self.approximate = _ACTS[hf.get("hidden_act", "gelu_pytorch_tanh")]
        self.windows = layer_windows(hf, cfg.num_layers)
        self.norm_bias: torch.Tensor | None = None

    def load_global(self, name: str, tensor: torch.Tensor) -> bool:
        if name != "model.norm.bias":
            return False
        self.norm_bias = self._param(tensor, self.head_device)
        return True

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "input_layernorm.weight",
            "input_layernorm.bias",
            "post_attention_layernorm.weight",
            "post_attention_layernorm.bias",
            "self_attn.o_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_proj.weight",
        }
        names |= {f"self_attn.{p}.weight" for p in _ATTN}
        if self.bias:
            names |= {f"self_attn.{p}.bias" for p in (*_ATTN, "o_proj")} | {"mlp.c_fc.bias", "mlp.c_proj.bias"}
        return frozenset(names)

    def finish_layer(self, layer: Starcoder2Layer, w: dict[str, Any], param) -> None:
        def opt(name: str) -> torch.Tensor | None:
            return param(w[name]) if self.bias else None

        a = "self_attn."
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.input_norm_bias = param(w["input_layernorm.bias"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        layer.post_norm_bias = param(w["post_attention_layernorm.bias"])
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.qkv_bias = param(torch.cat([w[a + p + ".bias"] for p in _ATTN])) if self.bias else None
        layer.o, layer.o_bias = param(w[a + "o_proj.weight"]), opt(a + "o_proj.bias")
        layer.fc, layer.fc_bias = param(w["mlp.c_fc.weight"]), opt("mlp.c_fc.bias")
        layer.proj, layer.proj_bias = param(w["mlp.c_proj.weight"]), opt("mlp.c_proj.bias")

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Starcoder2Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        h = ops.layer_norm(stream, layer.input_norm, layer.input_norm_bias, self.eps)
        q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
        q, k = self.rope(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale, self.windows[index])
        stream = stream + self._row_parallel(ops, attn, layer.o, layer.o_bias)
        h = ops.layer_norm(stream, layer.post_norm, layer.post_norm_bias, self.eps)
        h = ops.gelu(linear(ops, h, layer.fc, layer.fc_bias), self.approximate)
        return self._row_parallel(ops, h, layer.proj, layer.proj_bias), stream

    def _row_parallel(self, ops, x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, in / tp] -> [n, out]: the ranks' partial products summed, then the bias
        (whole on every rank) added once."""
        if self.parallel.tp_size == 1:
            return linear(ops, x, w, bias)
        out = self.parallel.all_reduce(linear(ops, x, w))
        return out if bias is None else out + bias

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.head_ops.layer_norm(x + residual, self.norm, self.norm_bias, self.eps)
