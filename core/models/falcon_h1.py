"""Falcon-H1 (``FalconH1ForCausalLM``): in every layer attention and a Mamba 2 mixer read
the same normed input side by side and their outputs are summed, then a SiLU-gated MLP;
muP multipliers throughout.

Two engine layers per checkpoint layer (``layers.engine_layer_count``): layer ``2 * i``
is layer ``i``'s attention, ``2 * i + 1`` its Mamba 2 mixer and MLP.  So each half has
the KV cache of its kind -- token blocks in an attention group, state pages in a
recurrent-state group (kv_cache/kv_groups.py) -- and prefix caching, chunked prefill,
preemption and swap work as for the one-mixer-per-layer hybrids.  The halves pass the
residual stream on so that the second sees the layer's input: the attention half
returns ``(attention output, r)`` with ``r`` the layer's input stream, the Mamba half
normalises ``r`` again (the same norm: one RMSNorm more per layer), adds both mixers'
outputs to ``r`` and runs the MLP.

Multipliers (transformers' ``modeling_falcon_h1``), folded into the weights at load,
as llama.cpp's converter does, except the embedding's and the LM head's (a tied
embedding is both):

- attention: ``attention_in_multiplier`` on its input (q, k and v weights),
  ``key_multiplier`` on k (weight and bias), ``attention_out_multiplier`` on o;
- Mamba 2: ``ssm_in_multiplier`` on its input, ``ssm_multipliers`` on the five parts
  of ``in_proj``'s output (z, x, B, C, dt: rows of the weight and bias),
  ``ssm_out_multiplier`` on ``out_proj``;
- MLP: ``mlp_multipliers`` on the gate projection's output and on the down projection's;
- ``embedding_multiplier`` on the embeddings, ``lm_head_multiplier`` on the logits.

Mamba 2 as Granite 4's (:class:`~pagedserve.models.mamba2.Mamba2Mixer`: the convolution
and SSD scan over state pages), with ``mamba_d_ssm`` channels (default
``mamba_expand * hidden_size``), optional biases (``mamba_proj_bias`` on ``in_proj``,
``projectors_bias`` on ``out_proj``) and the output gate as the config says: without
``mamba_rms_norm`` ``y * silu(z)``; with it a gated RMSNorm over ``mamba_n_groups``
groups, normalising before the gate (``mamba_norm_before_gate``) or after.  Attention:
RoPE, q/k/v/o biases with ``attention_bias``; MLP biases with ``mlp_bias``.

Tensor parallelism: the Mamba 2 mixer splits by heads and groups as Granite 4's
(:mod:`pagedserve.models.mamba2`: the z, x, B, C and dt rows of ``in_proj`` with their
bias and folded ``ssm_multipliers``, the convolution's channels, the norm's channels,
the columns of ``out_proj``; a norm group spanning ranks adds their sums of squares),
attention by heads, the MLP by intermediate rows.  The attention half hands its
row-parallel partial output to the Mamba half, which adds its own and sums the ranks'
once (one all-reduce for both mixers), then adds the two row-parallel biases (o_proj's
and out_proj's, whole on every rank and summed at load); the MLP's down projection is
summed over the ranks, then its bias added.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache
from pagedserve.models.granite_hybrid import _json_float
from pagedserve.models.layers import add_rms_norm, fuse, gated_mlp, layer_windows, linear, paged_attention, qkv_split
from pagedserve.models.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["FalconH1ForCausalLM", "FalconH1Layer"]

_ATTN = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")
_O_BIAS = "self_attn.o_proj.bias"
_MAMBA = ("dt_bias", "A_log", "D", "conv1d.weight", "in_proj.weight", "out_proj.weight")


class FalconH1Layer:
    """One engine layer (half a checkpoint layer).  ``attention``: True for the attention
    half (qkv [q + 2 kv, hidden], qkv_bias, o); else the Mamba half (in_proj
    [d_inner + conv_dim + heads, hidden], in_bias, conv [conv_dim, width], conv_bias,
    dt_bias, A (float32, = -exp(A_log)), D, out_norm [d_inner] or None, out_proj,
    out_bias: out_proj's bias plus o_proj's, added once both mixers' outputs are summed)
    with the MLP (ff_norm, gate_up [2 * inter, hidden], gate_up_bias, down, down_bias).
    Both halves hold the layer's ``input_norm``; multipliers are folded in."""

    __slots__ = (
        "attention",
        "input_norm",
        "qkv",
        "qkv_bias",
        "o",
        "in_proj",
        "in_bias",
        "conv",
        "conv_bias",
        "dt_bias",
        "A",
        "D",
        "out_norm",
        "out_proj",
        "out_bias",
        "ff_norm",
        "gate_up",
        "gate_up_bias",
        "down",
        "down_bias",
    )


def _scaled(t: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``t * scale`` computed in float32, back in ``t``'s dtype (rows: scale [rows, 1])."""
    return (t.float() * scale).to(t.dtype)


class FalconH1ForCausalLM(Mamba2Mixer, DecoderForCausalLM):
    layer_class = FalconH1Layer
    linear_fields = ("qkv", "o", "in_proj", "out_proj", "gate_up", "down")

    @classmethod
    def pipeline_refusal(cls, hf: dict) -> str | None:
        return "Falcon-H1's layers run attention and Mamba 2 side by side (two engine layers each, one stage)"

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        heads, groups = int(hf["mamba_n_heads"]), int(hf.get("mamba_n_groups", 1))
        return cls.mamba_refusal(heads, groups, tp, ("mamba_n_heads", "mamba_n_groups"))

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
        heads, groups = int(hf["mamba_n_heads"]), int(hf.get("mamba_n_groups", 1))
        if heads % groups:
            raise ValueError(f"{cfg.architecture}: mamba_n_heads must be a multiple of mamba_n_groups")
        if len(hf.get("ssm_multipliers") or [1.0] * 5) != 5 or len(hf.get("mlp_multipliers") or [1.0] * 2) != 2:
            raise ValueError(f"{cfg.architecture}: ssm_multipliers needs 5 values and mlp_multipliers 2")

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        hf = cfg.hf_config
        # [None, RECURRENT_STATE] * layers: each half's KV cache group (kv_cache/kv_groups.py).
        self.windows = layer_windows(hf, cfg.num_layers)
        heads, groups = int(hf["mamba_n_heads"]), int(hf.get("mamba_n_groups", 1))
        d_ssm = hf.get("mamba_d_ssm")
        d_inner = int(d_ssm) if d_ssm is not None else int(hf.get("mamba_expand", 2) * cfg.hidden_size)
        head_dim = hf.get("mamba_d_head", "auto")
        head_dim = d_inner // heads if head_dim in (None, "auto") else int(head_dim)
        if d_inner != heads * head_dim:
            raise ValueError(
                f"{cfg.architecture}: the Mamba width ({d_inner}) must equal mamba_n_heads * mamba_d_head "
                f"({heads} * {head_dim})"
            )
        # This rank's heads, groups, d_inner, conv_dim and state layout.
        self.set_mamba_shapes(heads, head_dim, groups, int(hf["mamba_d_state"]), int(hf.get("mamba_d_conv", 4)))
        self.chunk = int(hf.get("mamba_chunk_size", 256))
        limit = hf.get("time_step_limit") or (0.0, math.inf)
        self.dt_limit = (_json_float(limit[0]), _json_float(limit[1]))
        self.mamba_eps = cfg.rms_norm_eps
        self.mamba_rms_norm = bool(hf.get("mamba_rms_norm", False))
        self.norm_before_gate = bool(hf.get("mamba_norm_before_gate", True))
        self.embedding_multiplier = float(hf.get("embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(hf.get("lm_head_multiplier", 1.0))

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """The Mamba 2 mixer's tensors by heads and groups (``out_proj``'s bias whole: it is
        added after the all-reduce); attention and MLP as every family."""
        parts = local.split(".")
        if parts[0] == "mamba" and local != "mamba.out_proj.bias":
            out = self.shard_mamba_tensor(parts[1], local, t)
            if out is not None:
                return out
        return super().shard_layer_tensor(local, t)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return super().compute_logits(hidden, float32) * self.lm_head_multiplier

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._engine_names(weights))

    @staticmethod
    def _engine_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as engine layers: ``model.layers.<i>.self_attn.*`` to layer
        ``2 * i``, the rest of layer ``i`` (and o_proj's bias, added with out_proj's after
        both mixers' outputs are summed) to ``2 * i + 1``, its input norm to both;
        ``model.final_layernorm`` is the final norm."""
        for name, t in weights:
            if name == "model.final_layernorm.weight":
                yield "model.norm.weight", t
                continue
            if not name.startswith("model.layers."):
                yield name, t
                continue
            _, _, i, local = name.split(".", 3)
            attn, rest = f"model.layers.{2 * int(i)}.{local}", f"model.layers.{2 * int(i) + 1}.{local}"
            if local == "input_layernorm.weight":
                yield attn, t
                yield rest, t
            else:
                yield (attn if local.startswith("self_attn.") and local != _O_BIAS else rest), t

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        hf = self.cfg.hf_config
        names = {"input_layernorm.weight"}
        if layer % 2 == 0:
            names |= {f"self_attn.{p}.weight" for p in (*_ATTN, "o_proj")}
            if self.cfg.attention_bias:
                names |= {f"self_attn.{p}.bias" for p in _ATTN}
            return frozenset(names)
        names |= {"mamba." + n for n in _MAMBA} | {"pre_ff_layernorm.weight"}
        names |= {f"feed_forward.{p}.weight" for p in (*_MLP, "down_proj")}
        optional = {
            "mamba.conv1d.bias": hf.get("mamba_conv_bias", True),
            "mamba.in_proj.bias": hf.get("mamba_proj_bias", False),
            "mamba.out_proj.bias": hf.get("projectors_bias", False),
            "mamba.norm.weight": self.mamba_rms_norm,
            _O_BIAS: self.cfg.attention_bias,
        }
        names |= {n for n, on in optional.items() if on}
        if hf.get("mlp_bias", False):
            names |= {f"feed_forward.{p}.bias" for p in (*_MLP, "down_proj")}
        return frozenset(names)

    def finish_layer(self, layer: FalconH1Layer, w: dict[str, Any], param) -> None:
        for name in FalconH1Layer.__slots__:
            setattr(layer, name, None)
        layer.input_norm = param(w["input_layernorm.weight"])
        layer.attention = "self_attn.q_proj.weight" in w
        hf = self.cfg.hf_config
        if layer.attention:
            a = "self_attn."
            scale_in, key = float(hf.get("attention_in_multiplier", 1.0)), float(hf.get("key_multiplier", 1.0))
            scale_out = float(hf.get("attention_out_multiplier", 1.0))
            q, k, v = (w[a + p + ".weight"] for p in _ATTN)
            layer.qkv = param(fuse([_scaled(q, scale_in), _scaled(k, scale_in * key), _scaled(v, scale_in)]))
            layer.o = param(_scaled(w[a + "o_proj.weight"], scale_out))
            if self.cfg.attention_bias:
                qb, kb, vb = (w[a + p + ".bias"] for p in _ATTN)
                layer.qkv_bias = param(torch.cat([qb, _scaled(kb, key), vb]))
            return
        m = "mamba."
        mup = self._mup_vector()
        scale_in, scale_out = float(hf.get("ssm_in_multiplier", 1.0)), float(hf.get("ssm_out_multiplier", 1.0))
        layer.in_proj = param(_scaled(w[m + "in_proj.weight"], mup.view(-1, 1) * scale_in))
        if m + "in_proj.bias" in w:
            layer.in_bias = param(_scaled(w[m + "in_proj.bias"], mup))
        layer.conv = param(w[m + "conv1d.weight"].reshape(self.conv_dim, self.width))
        layer.conv_bias = param(w[m + "conv1d.bias"]) if m + "conv1d.bias" in w else None
        layer.dt_bias = param(w[m + "dt_bias"]).float()
        layer.A = -param(w[m + "A_log"]).float().exp()
        layer.D = param(w[m + "D"]).float()
        layer.out_norm = param(w[m + "norm.weight"]) if m + "norm.weight" in w else None
        layer.out_proj = param(_scaled(w[m + "out_proj.weight"], scale_out))
        # The two mixers' row-parallel biases (whole on every rank), added once as one.
        biases = [_scaled(w[m + "out_proj.bias"], scale_out)] if m + "out_proj.bias" in w else []
        if _O_BIAS in w:
            biases.append(_scaled(w[_O_BIAS], float(hf.get("attention_out_multiplier", 1.0))))
        if biases:
            layer.out_bias = param(sum(b.float() for b in biases).to(biases[0].dtype))
        f = "feed_forward."
        gate_mult, down_mult = (float(x) for x in hf.get("mlp_multipliers") or (1.0, 1.0))
        layer.ff_norm = param(w["pre_ff_layernorm.weight"])
        layer.gate_up = param(fuse([_scaled(w[f + "gate_proj.weight"], gate_mult), w[f + "up_proj.weight"]]))
        layer.down = param(_scaled(w[f + "down_proj.weight"], down_mult))
        if f + "down_proj.bias" in w:
            layer.gate_up_bias = param(torch.cat([_scaled(w[f + "gate_proj.bias"], gate_mult), w[f + "up_proj.bias"]]))
            layer.down_bias = param(_scaled(w[f + "down_proj.bias"], down_mult))

    def _mup_vector(self) -> torch.Tensor:
        """float32 [d_inner + conv_dim + heads] (this rank's rows): ``ssm_multipliers`` over
        in_proj's z, x, B, C and dt rows (transformers' ``compute_mup_vector``)."""
        mults = [float(x) for x in self.cfg.hf_config.get("ssm_multipliers") or [1.0] * 5]
        d_inner, groups, heads = self.mamba_global
        gn = groups * self.d_state
        sizes = [d_inner, d_inner, gn, gn, heads]
        full = torch.cat([torch.full((n,), s, dtype=torch.float32) for n, s in zip(sizes, mults)])
        if self.parallel.tp_size == 1:
            return full
        return self.shard_mamba_tensor("in_proj", "mamba.in_proj.weight", full)

    # -- forward ------------------------------------------------------------------------------
    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: FalconH1Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        if layer.attention:
            # (x, residual): the previous layer's output and stream -> (attention out, stream).
            h, residual = add_rms_norm(ops, x, residual, layer.input_norm, eps)
            q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
            q, k = self.rope(ops, placement, meta.positions, q, k)
            attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale)
            # This rank's share of o_proj's output (summed over the ranks, with o_proj's
            # bias, by the Mamba half).
            return linear(ops, attn, layer.o), residual
        # (x, residual): the attention half's partial output and the layer's input stream.
        h = ops.rms_norm(residual, layer.input_norm, eps)
        mixed = self.parallel.all_reduce(x + self._mamba(ops, layer, h, kv_cache, meta))
        if layer.out_bias is not None:
            mixed = mixed + layer.out_bias
        h, residual = ops.fused_add_rms_norm(mixed, residual, layer.ff_norm, eps)
        if layer.gate_up_bias is None:
            return self.parallel.all_reduce(gated_mlp(ops, h, layer.gate_up, layer.down)), residual
        up = ops.silu_and_mul(linear(ops, h, layer.gate_up, layer.gate_up_bias))
        if self.parallel.tp_size == 1:
            return linear(ops, up, layer.down, layer.down_bias), residual
        return self.parallel.all_reduce(linear(ops, up, layer.down)) + layer.down_bias, residual
