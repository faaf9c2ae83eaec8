"""GGUF architectures of the hybrid families: recurrent-state layers beside attention.

What llama.cpp's converter (``convert_hf_to_gguf.py`` and its ``conversion/`` modules in
the tree llama-cpp-python 0.3.36 vendors: ``Qwen3NextModel``,
``_LinearAttentionVReorderBase``, ``LFM2Model``, ``Mamba2Model``, ``GraniteHybridModel``,
``NemotronHModel``)
does to these checkpoints, and how it is undone here so the models see a safetensors
export:

- ``qwen35`` / ``qwen35moe`` (Qwen3.5 text, dense and MoE): ``A_log`` stored as
  ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``; the conv1d weight squeezed to
  ``[channels, width]``; every RMSNorm weight but the DeltaNet's output norm stored as
  ``1 + w``.  With fewer key than value heads the value heads are reordered from grouped
  by key head (``[k0: v0..v(r-1), k1: ...]``) to tiled (``[v0 of k0, v0 of k1, ...]``) in
  ``in_proj_qkv``'s value rows, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log``,
  ``dt_bias``, the conv1d's value channels and ``out_proj``'s columns; rows go back as
  stored bytes (quantized blocks kept), ``out_proj``'s columns as whole blocks where a
  head's columns are whole blocks, else it loads dequantized.  The value head size is
  ``ssm.inner_size / ssm.time_step_rank`` (llama.cpp's own runtime assumes it equals the
  key head size, ``ssm.state_size``); layer kinds come from
  ``attention.recurrent_layers`` or ``full_attention_interval`` (default 4); the
  M-RoPE sections the converter always writes are plain RoPE for text (equal positions).
- ``lfm2``: the short convolution's weight squeezed to ``[hidden, width]``; the final
  norm is ``token_embd_norm``; conv layers are those whose ``attention.head_count_kv``
  entry is 0; the feed-forward size stored is the one the tensors have.
- ``granitehybrid`` (Granite 4): Mamba 2 layers as ``Mamba2Model`` writes them (``ssm_a``
  and ``ssm_d`` as ``[heads, 1]``, ``ssm_norm`` as ``[groups, d_inner / groups]``,
  conv1d squeezed); attention q/k rows interleaved as for Llama; the experts'
  ``input_linear`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` and the shared MLP's into
  ``ffn_gate_shexp`` / ``ffn_up_shexp`` (``ffn_gate`` / ``ffn_up`` without experts), put
  back together here; attention layers are those with KV heads; RoPE only when
  ``rope.scaling.finetuned`` (llama.cpp's default: true); the vocabulary size key is
  padded to a multiple of 8, the embedding's rows are the model's.

- ``nemotron_h``: Mamba 2 layers as for Granite 4, q/k rows interleaved likewise (the
  converter class derives from ``GraniteHybridModel``), each layer's kind from its
  ``attention.head_count_kv`` / ``feed_forward_length`` entries (llama.cpp's rule: KV heads:
  attention; a feed-forward size: MLP; neither: Mamba 2), vocabulary padded as Granite's.

- ``qwen3next``: Qwen3.5's rewrites without the value-head reorder; ``in_proj_qkvz`` (packed
  per key head) split into ``attn_qkv`` and ``attn_gate`` (each head-major), packed back
  here; ``in_proj_ba`` stored as it is (``ssm_ba``).

- ``jamba``: Mamba 1 layers (``ssm_a = -exp(A_log)`` ``[d_inner, d_state]``, conv1d
  squeezed, ``ssm_x``, ``ssm_dt`` weight and bias, the three inner norms); attention and
  MoE layers found from the KV-head array and the router tensors, as the periods and
  offsets of the config.

Other hybrid names llama.cpp writes (``nemotron_h_moe``, ``falcon-h1``, ``lfm2moe``) are
refused by name (``UNSUPPORTED_HYBRID``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.loader.gguf_arch import (
    _LLAMA_BLOCK,
    _QWEN_EXPERTS,
    _QWEN_MOE_BLOCK,
    Fix,
    GGUFArch,
    Metadata,
    _granite,
)

__all__ = ["HYBRID_ARCHS", "UNSUPPORTED_HYBRID", "column_groups", "row_order"]

#: llama.cpp architectures of hybrid families pagedserve loads from Hugging Face
#: checkpoints only, with the HF class to use instead.
UNSUPPORTED_HYBRID = {
    "nemotron_h_moe": "NemotronHForCausalLM",
    "falcon-h1": "FalconH1ForCausalLM",
    "lfm2moe": "Lfm2MoeForCausalLM (not implemented)",
}


def _conv(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The converter squeezed the depthwise conv1d weight [channels, 1, width]."""
    return (shape[0], 1, shape[-1])


def _flat(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (int(np.prod(shape)),)


def _a_log(a: np.ndarray) -> np.ndarray:
    """``ssm_a`` holds ``A = -exp(A_log)``."""
    return np.log(-a.astype(np.float64)).astype(np.float32)


_CONV = Fix(_conv)
_A_LOG = Fix(_flat, _a_log)
_FLAT = Fix(_flat)


def _kv_heads_per_layer(meta: Metadata) -> list[int]:
    """``attention.head_count_kv`` per layer (an array in the hybrid files: 0 for a
    recurrent layer), or the one value repeated."""
    value = meta.get("attention.head_count_kv")
    n = meta.num_layers()
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            meta.refuse(f"an attention.head_count_kv array of {len(value)} entries for {n} layers")
        return [int(v) for v in value]
    return [int(value if value is not None else meta.get("attention.head_count"))] * n


def _vocab_from_embedding(meta: Metadata, base: dict[str, Any]) -> int:
    shape = meta.shapes.get("token_embd.weight")
    return int(shape[0]) if shape else base["vocab_size"]


# -- Qwen3.5 ----------------------------------------------------------------------------


def _qwen35_sizes(hf: dict[str, Any]) -> tuple[int, int, int, int]:
    return (
        int(hf["linear_num_key_heads"]),
        int(hf["linear_num_value_heads"]) // int(hf["linear_num_key_heads"]),
        int(hf["linear_key_head_dim"]),
        int(hf["linear_value_head_dim"]),
    )


def _untile(k: int, r: int, d: int) -> np.ndarray:
    """Stored index of each Hugging Face index of [k * r * d] value rows: HF holds them
    grouped by key head ``(k, r, d)``, the file tiled ``(r, k, d)``."""
    return np.arange(k * r * d).reshape(r, k, d).transpose(1, 0, 2).reshape(-1)


def _qwen35_rows(name: str, hf: dict[str, Any]) -> np.ndarray | None:
    k, r, dk, dv = _qwen35_sizes(hf)
    if r == 1:
        return None
    if name in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        qk = 2 * k * dk
        return np.concatenate([np.arange(qk), qk + _untile(k, r, dv)])
    if name == "linear_attn.in_proj_z.weight":
        return _untile(k, r, dv)
    if name in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        return _untile(k, r, 1)
    if name in ("linear_attn.A_log", "linear_attn.dt_bias"):
        return _untile(k, r, 1)
    return None


def _qwen35_columns(name: str, hf: dict[str, Any]) -> tuple[np.ndarray, int] | None:
    k, r, dk, dv = _qwen35_sizes(hf)
    if r == 1 or name != "linear_attn.out_proj.weight":
        return None
    return _untile(k, r, 1), dv


def _qwen3next_rows(name: str, hf: dict[str, Any]) -> np.ndarray | None:
    """``in_proj_qkvz`` from ``attn_qkv`` then ``attn_gate`` (q, k, v, z each head-major):
    each key head's q, k, then its value heads' v and z, as the checkpoint packs them."""
    if name != "linear_attn.in_proj_qkvz.weight":
        return None
    k, r, dk, dv = _qwen35_sizes(hf)
    q, kk, v, z = (np.arange(n) for n in (k * dk, k * dk, k * r * dv, k * r * dv))
    starts = np.cumsum([0, k * dk, k * dk, k * r * dv])
    per_head = [
        np.concatenate(
            [
                starts[0] + q[h * dk : (h + 1) * dk],
                starts[1] + kk[h * dk : (h + 1) * dk],
                starts[2] + v[h * r * dv : (h + 1) * r * dv],
                starts[3] + z[h * r * dv : (h + 1) * r * dv],
            ]
        )
        for h in range(k)
    ]
    return np.concatenate(per_head)


def _qwen3next(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    out = _qwen35(meta, base)
    sparse = set(meta.layers_with("ffn_gate_inp"))
    shared = meta.get("expert_shared_feed_forward_length")
    out.update(
        num_experts=int(meta.get("expert_count", 0) or 0),
        num_experts_per_tok=int(meta.get("expert_used_count", 0) or 0),
        moe_intermediate_size=int(meta.get("expert_feed_forward_length", base["intermediate_size"])),
        shared_expert_intermediate_size=int(shared) if shared is not None else base["intermediate_size"],
        norm_topk_prob=True,  # llama.cpp always renormalises Qwen3-Next's top-k weights
        mlp_only_layers=[i for i in range(meta.num_layers()) if i not in sparse],
        decoder_sparse_step=1,
    )
    return out


def _qwen35(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    n = meta.num_layers()
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) != n:
            meta.refuse(f"an attention.recurrent_layers array of {len(recurrent)} entries for {n} layers")
        linear = [bool(x) for x in recurrent]
    else:
        interval = int(meta.get("full_attention_interval", 4))
        linear = [(i + 1) % interval != 0 for i in range(n)]
    if meta.get("nextn_predict_layers"):
        meta.refuse("multi-token-prediction layers (nextn_predict_layers)")
    v_heads = int(meta.get("ssm.time_step_rank"))
    rope_dims = meta.get("rope.dimension_count")
    out: dict[str, Any] = {
        "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        "linear_num_key_heads": int(meta.get("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(meta.get("ssm.state_size")),
        "linear_value_head_dim": int(meta.get("ssm.inner_size")) // v_heads,
        "linear_conv_kernel_dim": int(meta.get("ssm.conv_kernel")),
        "partial_rotary_factor": int(rope_dims) / base["head_dim"] if rope_dims is not None else 0.25,
    }
    if meta.get("expert_count"):
        gating = meta.get("expert_gating_func")
        if gating is not None and int(gating) not in (0, 1):
            meta.refuse(f"expert gating function {int(gating)} (only softmax is implemented)")
        shared = meta.get("expert_shared_feed_forward_length")
        out.update(
            num_experts=int(meta.get("expert_count")),
            num_experts_per_tok=int(meta.get("expert_used_count")),
            moe_intermediate_size=int(meta.get("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(shared) if shared is not None else base["intermediate_size"],
            norm_topk_prob=True,  # llama.cpp always renormalises Qwen3.5-MoE's top-k weights
        )
    return out


_QWEN35_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
del _QWEN35_BLOCK["ffn_norm"]
_QWEN35_TENSORS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_QWEN35_FIXES = {"linear_attn.A_log": Fix(lambda s: s, _a_log), "linear_attn.conv1d.weight": _CONV}


def _qwen35_arch(model_type: str, architecture: str, moe: bool) -> GGUFArch:
    sparse = {k: v for k, v in _QWEN_MOE_BLOCK.items() if k not in _LLAMA_BLOCK}  # router, shared expert
    block = {**_QWEN35_BLOCK, **(sparse if moe else {})}
    return GGUFArch(
        model_type,
        architecture,
        block,
        norm_shift=1.0,
        unshifted_norms=frozenset({"linear_attn.norm.weight"}),
        experts=dict(_QWEN_EXPERTS) if moe else {},
        tensors=dict(_QWEN35_TENSORS),
        fixes=dict(_QWEN35_FIXES),
        rows=_qwen35_rows,
        columns=_qwen35_columns,
        config=_qwen35,
    )


# -- LFM2 -------------------------------------------------------------------------------


def _lfm2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    kv = _kv_heads_per_layer(meta)
    if not any(kv):
        meta.refuse("no attention layer (every attention.head_count_kv entry is 0)")
    if meta.get("attention.sliding_window"):
        meta.refuse("sliding-window attention under architecture 'lfm2'")
    conv_layers = [i for i, h in enumerate(kv) if h == 0]
    return {
        "layer_types": ["conv" if h == 0 else "full_attention" for h in kv],
        "num_key_value_heads": max(kv),
        "conv_L_cache": int(meta.get("shortconv.l_cache", 3)),
        "conv_bias": bool(conv_layers) and f"blk.{conv_layers[0]}.shortconv.conv.bias" in meta.names,
        "norm_eps": base["rms_norm_eps"],
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": base["intermediate_size"],
    }


_LFM2_BLOCK = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}


# -- Granite 4 ----------------------------------------------------------------------------


def _granitehybrid(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    kv = _kv_heads_per_layer(meta)
    if not any(kv):
        meta.refuse("no attention layer (every attention.head_count_kv entry is 0)")
    hidden = base["hidden_size"]
    heads, inner = int(meta.get("ssm.time_step_rank")), int(meta.get("ssm.inner_size"))
    mamba_layers = [i for i, h in enumerate(kv) if h == 0]
    experts = int(meta.get("expert_count", 0) or 0)
    gating = meta.get("expert_gating_func")
    if experts and gating is not None and int(gating) not in (0, 1):
        meta.refuse(f"expert gating function {int(gating)} (only softmax is implemented)")
    shared = meta.get("expert_shared_feed_forward_length")
    if shared is None:  # no experts: the shared MLP is stored as the dense ffn_*
        down = meta.shapes.get(f"blk.0.{'ffn_down_shexp' if experts else 'ffn_down'}.weight")
        shared = down[-1] if down else base["intermediate_size"]
    return {
        **_granite(meta, base),
        "vocab_size": _vocab_from_embedding(meta, base),
        "layer_types": ["mamba" if h == 0 else "attention" for h in kv],
        "num_key_value_heads": max(kv),
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_d_state": int(meta.get("ssm.state_size")),
        "mamba_n_groups": int(meta.get("ssm.group_count", 1)),
        "mamba_d_conv": int(meta.get("ssm.conv_kernel")),
        "mamba_expand": inner / hidden,
        "mamba_conv_bias": bool(mamba_layers) and f"blk.{mamba_layers[0]}.ssm_conv1d.bias" in meta.names,
        "mamba_proj_bias": False,
        # llama.cpp: RoPE unless the file says rope.scaling.finetuned = false (Granite 4 does).
        "position_embedding_type": "rope" if meta.get("rope.scaling.finetuned", True) else "nope",
        "num_local_experts": experts,
        "num_experts_per_tok": int(meta.get("expert_used_count", 0) or 0),
        "shared_intermediate_size": int(shared),
    }


_GRANITE_HYBRID_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_down_exps": "block_sparse_moe.output_linear",
    "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_down": "shared_mlp.output_linear",
}
_MAMBA2_TENSORS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}
_MAMBA2_FIXES = {"mamba.A_log": _A_LOG, "mamba.D": _FLAT, "mamba.norm.weight": _FLAT, "mamba.conv1d.weight": _CONV}


# -- Nemotron-H ---------------------------------------------------------------------------


def _nemotron_h(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp: a layer with KV heads is attention, one with a feed-forward size an MLP,
    one with neither Mamba 2 (``attention.head_count_kv`` and ``feed_forward_length`` are
    per-layer arrays); the MLP is squared ReLU, not stored."""
    kv = _kv_heads_per_layer(meta)
    ff = meta.get("feed_forward_length")
    ff = [int(f) for f in ff] if isinstance(ff, (list, tuple)) else [0] * len(kv)
    if len(ff) != len(kv):
        meta.refuse(f"a feed_forward_length array of {len(ff)} entries for {len(kv)} layers")
    kinds = ["full_attention" if h else "mlp" if f else "linear_attention" for h, f in zip(kv, ff)]
    heads, inner = int(meta.get("ssm.time_step_rank")), int(meta.get("ssm.inner_size"))
    mamba_layers = [i for i, k in enumerate(kinds) if k == "linear_attention"]
    eps = meta.get("attention.layer_norm_rms_epsilon", meta.get("attention.layer_norm_epsilon", 1e-5))
    return {
        "vocab_size": _vocab_from_embedding(meta, base),
        "layers_block_type": kinds,
        "num_key_value_heads": max(kv) or base["num_attention_heads"],
        "intermediate_size": max(ff) or base["hidden_size"],
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "ssm_state_size": int(meta.get("ssm.state_size")),
        "n_groups": int(meta.get("ssm.group_count", 1)),
        "conv_kernel": int(meta.get("ssm.conv_kernel")),
        "use_conv_bias": bool(mamba_layers) and f"blk.{mamba_layers[0]}.ssm_conv1d.bias" in meta.names,
        "layer_norm_epsilon": float(eps),
        "rms_norm_eps": float(eps),
        "mlp_hidden_act": "relu2",
    }


_NEMOTRON_H_BLOCK = {
    "attn_norm": "norm",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
}


_QWEN3NEXT_BLOCK = {
    **{k: v for k, v in _QWEN35_BLOCK.items() if k not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")},
    **{k: v for k, v in _QWEN_MOE_BLOCK.items() if k not in _LLAMA_BLOCK},
    "ssm_ba": "linear_attn.in_proj_ba",
}


# -- Jamba ---------------------------------------------------------------------------------


def _period(meta: Metadata, layers: list[int], what: str) -> tuple[int, int]:
    """(period, offset) with ``layers`` exactly the ``i % period == offset`` ones."""
    n = meta.num_layers()
    offset = layers[0]
    period = layers[1] - layers[0] if len(layers) > 1 else n
    if layers != [i for i in range(n) if i % period == offset]:
        meta.refuse(f"{what} layers {layers}, which are not every n-th layer")
    return period, offset


def _jamba(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    kv = _kv_heads_per_layer(meta)
    attention = [i for i, h in enumerate(kv) if h]
    if not attention:
        meta.refuse("no attention layer (every attention.head_count_kv entry is 0)")
    attn_period, attn_offset = _period(meta, attention, "attention")
    sparse = meta.layers_with("ffn_gate_inp")
    expert_period, expert_offset = _period(meta, sparse, "MoE") if sparse else (meta.num_layers() + 1, 0)
    hidden, inner = base["hidden_size"], int(meta.get("ssm.inner_size"))
    if inner % hidden:
        meta.refuse(f"ssm.inner_size {inner}, not a multiple of the hidden size {hidden}")
    mamba = [i for i, h in enumerate(kv) if not h]
    return {
        "num_key_value_heads": max(kv),
        "attn_layer_period": attn_period,
        "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period,
        "expert_layer_offset": expert_offset,
        "num_experts": int(meta.get("expert_count", 1) or 1) if sparse else 1,
        "num_experts_per_tok": int(meta.get("expert_used_count", 2) or 2),
        "mamba_d_state": int(meta.get("ssm.state_size")),
        "mamba_d_conv": int(meta.get("ssm.conv_kernel")),
        "mamba_expand": inner // hidden,
        "mamba_dt_rank": int(meta.get("ssm.time_step_rank")),
        "mamba_conv_bias": bool(mamba) and f"blk.{mamba[0]}.ssm_conv1d.bias" in meta.names,
        "mamba_proj_bias": False,
    }


_JAMBA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "pre_ff_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_x": "mamba.x_proj",
    "ssm_dt": "mamba.dt_proj",
    "ssm_dt_norm": "mamba.dt_layernorm",
    "ssm_b_norm": "mamba.b_layernorm",
    "ssm_c_norm": "mamba.c_layernorm",
    "ssm_out": "mamba.out_proj",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}


HYBRID_ARCHS: dict[str, GGUFArch] = {
    "qwen35": _qwen35_arch("qwen3_5_text", "Qwen3_5ForCausalLM", moe=False),
    "qwen35moe": _qwen35_arch("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe=True),
    "qwen3next": GGUFArch(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        _QWEN3NEXT_BLOCK,
        norm_shift=1.0,
        unshifted_norms=frozenset({"linear_attn.norm.weight"}),
        experts=dict(_QWEN_EXPERTS),
        tensors=dict(_QWEN35_TENSORS),
        fixes=dict(_QWEN35_FIXES),
        merged=(("linear_attn.in_proj_qkvz.weight", ("attn_qkv", "attn_gate")),),
        rows=_qwen3next_rows,
        config=_qwen3next,
    ),
    "lfm2": GGUFArch(
        "lfm2",
        "Lfm2ForCausalLM",
        dict(_LFM2_BLOCK),
        globals={"token_embd_norm.weight": "model.embedding_norm.weight"},
        fixes={"conv.conv.weight": _CONV},
        config=_lfm2,
    ),
    "granitehybrid": GGUFArch(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        dict(_GRANITE_HYBRID_BLOCK),
        permute_qk=True,
        tensors=dict(_MAMBA2_TENSORS),
        fixes=dict(_MAMBA2_FIXES),
        merged=(
            ("block_sparse_moe.input_linear.weight", ("ffn_gate_exps", "ffn_up_exps")),
            ("shared_mlp.input_linear.weight", ("ffn_gate_shexp", "ffn_up_shexp")),
            ("shared_mlp.input_linear.weight", ("ffn_gate", "ffn_up")),  # no experts
        ),
        config=_granitehybrid,
    ),
    "jamba": GGUFArch(
        "jamba",
        "JambaForCausalLM",
        dict(_JAMBA_BLOCK),
        experts=dict(_QWEN_EXPERTS),
        expert_prefix="feed_forward.experts",
        tensors={"ssm_a": "mamba.A_log", "ssm_d": "mamba.D"},
        globals={"output_norm.weight": "model.final_layernorm.weight"},
        fixes={"mamba.A_log": Fix(lambda s: s, _a_log), "mamba.conv1d.weight": _CONV},
        config=_jamba,
    ),
    "nemotron_h": GGUFArch(
        "nemotron_h",
        "NemotronHForCausalLM",
        dict(_NEMOTRON_H_BLOCK),
        permute_qk=True,  # GraniteHybridModel's undo_permute, inherited
        tensors={k: v.replace("mamba.", "mixer.") for k, v in _MAMBA2_TENSORS.items()},
        fixes={k.replace("mamba.", "mixer."): v for k, v in _MAMBA2_FIXES.items()},
        config=_nemotron_h,
    ),
}


def row_order(arch: GGUFArch, name: str, config: dict[str, Any]) -> np.ndarray | None:
    """Stored row of each Hugging Face row of ``name`` (under ``model.layers.<i>.``), or None."""
    return None if arch.rows is None else arch.rows(name, config)


def column_groups(arch: GGUFArch, name: str, config: dict[str, Any]) -> tuple[np.ndarray, int] | None:
    """(stored group of each Hugging Face group of columns, group width) of ``name``, or None."""
    return None if arch.columns is None else arch.columns(name, config)
