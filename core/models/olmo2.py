"""OLMo 2: post-norm decoder layers (a norm on each sublayer's output, none on its
input) and q/k RMSNorm over the whole projection (all heads at once), composed from
:mod:`pagedserve.models.layers`.

Under tensor parallelism each rank holds some heads of q and k, but their norms run
over the whole projection: the ranks all-reduce each token's sum of squares (two
floats per token and layer) rather than all-gathering the projections (the whole
q and k, to then keep only this rank's heads), and each rank scales its own heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.layers import fuse, gated_mlp, layer_windows, linear, paged_attention, qkv_split

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Olmo2ForCausalLM", "Olmo2Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")


class Olmo2Layer:
    """One layer: post-attention and post-feed-forward norms [hidden]; q_norm [heads *
    head_dim] and k_norm [kv_heads * head_dim] over the whole projections."""

    __slots__ = ("post_attn_norm", "post_ff_norm", "qkv", "q_norm", "k_norm", "o", "gate_up", "down")


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_class = Olmo2Layer
    linear_fields = ("qkv", "o", "gate_up", "down")

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        if cfg.attention_bias:
            raise ValueError("Olmo2ForCausalLM: attention_bias=true is not supported")
        if any(layer_windows(cfg.hf_config, cfg.num_layers)):
            raise ValueError("Olmo2ForCausalLM: sliding windows are not supported")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "post_attention_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        return frozenset(names | {f"self_attn.{p}.weight" for p in _ATTN})

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        # The whole-projection norm weights follow their projection's heads.
        if local == "self_attn.q_norm.weight":
            return self.q_rows(t)
        if local == "self_attn.k_norm.weight":
            return self.kv_rows(t)
        return super().shard_layer_tensor(local, t)

    def window_of(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (OLMo 2 has none)."""
        return None

    def rope_for(self, index: int):
        """Layer ``index``'s rotary embedding."""
        return self.rope

    def finish_layer(self, layer: Olmo2Layer, w: dict[str, Any], param) -> None:
        a = "self_attn."
        layer.post_attn_norm = param(w["post_attention_layernorm.weight"])
        layer.post_ff_norm = param(w["post_feedforward_layernorm.weight"])
        layer.qkv = param(fuse([w[a + p + ".weight"] for p in _ATTN]))
        layer.q_norm = param(w[a + "q_norm.weight"])
        layer.k_norm = param(w[a + "k_norm.weight"])
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Olmo2Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        stream = x if residual is None else x + residual  # no input norm: attention reads the stream
        qkv = linear(ops, stream, layer.qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._qk_norm(ops, q, k, layer, eps)
        q, k, v = qkv_split(torch.cat([q, k, v], dim=-1), self.attn)
        q, k = self.rope_for(index)(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale, self.window_of(index))
        h = linear(ops, attn, layer.o)
        stream = stream + ops.rms_norm(self.parallel.all_reduce(h), layer.post_attn_norm, eps)
        h = self.parallel.all_reduce(gated_mlp(ops, stream, layer.gate_up, layer.down))
        return ops.rms_norm(h, layer.post_ff_norm, eps), stream

    def _qk_norm(
        self, ops, q: torch.Tensor, k: torch.Tensor, layer: Olmo2Layer, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of q [n, q_size] and k [n, kv_size] over the whole projections, of
        which these are this rank's heads."""
        p, cfg = self.parallel, self.cfg
        if p.tp_size == 1:
            return ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)
        qf, kf = q.float(), k.float()
        sums = p.all_reduce(torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=-1))
        # With fewer KV heads than ranks each KV head sits on tp / kv_heads ranks.
        k_copies = max(1, p.tp_size // cfg.num_kv_heads)
        q_var = sums[:, :1] / (cfg.num_heads * cfg.head_dim)
        k_var = sums[:, 1:] / (k_copies * cfg.num_kv_heads * cfg.head_dim)
        q = (qf * torch.rsqrt(q_var + eps) * layer.q_norm.float()).to(q.dtype)
        k = (kf * torch.rsqrt(k_var + eps) * layer.k_norm.float()).to(k.dtype)
        return q, k
