"""What each GGUF architecture changes in the translation to a Hugging Face checkpoint.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes every family under its own
``general.architecture`` with llama.cpp metadata keys and tensor names, and rewrites some
tensors on the way: it interleaves the Q/K rows of Llama-derived families (``llama``,
``granite``, ``smollm3``) for its RoPE kernel, stores Gemma 2/3 RMSNorm weights as
``1 + w``, stacks each MoE layer's experts into one ``[n_expert, rows, cols]`` tensor and
keeps Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` and GLM-4's fused ``gate_up_proj``
as they are.  Some facts are not stored at all and llama.cpp's runtime fixes them
(SmolLM3's NoPE every fourth layer, Gemma's query scale, Qwen-MoE's renormalisation):
those are filled in here the same way.

``GGUFArch`` records, per architecture, the tensor-name table and these rewrites;
``ARCH_CONFIG`` the config entries read from (or implied by) its metadata.  The generic
part (shapes, RoPE, tokens) lives in ``gguf_checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Fix", "GGUFArch", "GGUF_ARCHS", "Metadata", "arch_config", "expert_target"]

#: Block tensors shared by the Llama-like layouts: GGUF part -> HF suffix under ``model.layers.<i>.``.
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 sandwich norms: llama.cpp's "ffn_norm" is the norm before the MLP here.
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK = {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_OLMO2_BLOCK = {
    **{k: v for k, v in _LLAMA_BLOCK.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLM4_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
_STARCODER2_BLOCK = {**_LLAMA_BLOCK, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Routed experts: GGUF part -> HF name of one expert's matrix, per family.
_QWEN_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_QWEN_MOE_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MIXTRAL_BLOCK = {**_LLAMA_BLOCK, "ffn_gate_inp": "block_sparse_moe.gate"}
# DeepSeek-V2's latent attention; attn_k_b / attn_v_b (the split kv_b_proj of newer
# converters) both become kv_b_proj, put back together by gguf_mla.
_DEEPSEEK2_BLOCK = {
    **{k: v for k, v in _LLAMA_BLOCK.items() if k not in ("attn_k", "attn_v", "attn_q_norm", "attn_k_norm")},
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",
    "attn_v_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


class Fix:
    """A converter rewrite of one tensor that is not a rename, undone at load: ``shape``
    maps the stored (numpy-order) shape to the Hugging Face one, ``values`` the float32
    values (already in the stored shape) to the Hugging Face values.  A fixed tensor always
    loads dequantized."""

    def __init__(
        self,
        shape: Callable[[tuple[int, ...]], tuple[int, ...]],
        values: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.shape, self._values = shape, values

    def apply(self, a: np.ndarray) -> np.ndarray:
        if self._values is not None:
            a = self._values(a)
        return np.ascontiguousarray(a.reshape(self.shape(a.shape)), dtype=np.float32)


@dataclass(frozen=True)
class GGUFArch:
    """One ``general.architecture``: the HF family, names, and the converter's rewrites.

    block: GGUF block part (``blk.<i>.<part>.weight``) -> HF suffix (``model.layers.<i>.<suffix>``).
    tensors: whole GGUF block tensor names (``ssm_a``, ``ssm_dt.bias``, ...) -> HF names
        under ``model.layers.<i>.`` (with their suffix); looked up before ``block``.
    globals: GGUF names outside the blocks -> HF names, over the common ones.
    merged: (HF name under ``model.layers.<i>.``, the GGUF block parts the converter split
        it into, in order) pairs; the parts' rows (the second-to-last numpy axis) are
        concatenated back.
    fixes: HF name under ``model.layers.<i>.`` -> the :class:`Fix` that undoes what the
        converter did to it (besides a rename).
    rows: (HF name under ``model.layers.<i>.``, HF config) -> the stored row of each HF
        row, or None: rows the converter reordered (moved as stored bytes, so quantized
        blocks stay).
    columns: (HF name, HF config) -> (the stored group of each HF group of columns, the
        group's width), or None: columns the converter reordered in groups.
    permute_qk: llama.cpp interleaved each head's Q/K rows (weights and biases).
    norm_shift: added by the converter to every ``*norm.weight`` (Gemma's 1 + w) but
        those named in ``unshifted_norms`` (HF names under ``model.layers.<i>.``).
    experts: stacked expert part -> one expert's HF matrix name; ``expert_prefix`` is
        the HF path of the experts (``mlp.experts.<e>.<name>.weight``).
    config: the architecture's own config entries (else ``ARCH_CONFIG`` by model type).
    """

    model_type: str
    architecture: str
    block: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_BLOCK))
    permute_qk: bool = False
    norm_shift: float = 0.0
    experts: dict[str, str] = field(default_factory=dict)
    expert_prefix: str = "mlp.experts"
    tensors: dict[str, str] = field(default_factory=dict)
    globals: dict[str, str] = field(default_factory=dict)
    merged: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fixes: dict[str, Fix] = field(default_factory=dict)
    unshifted_norms: frozenset[str] = frozenset()
    rows: Callable[[str, dict[str, Any]], np.ndarray | None] | None = None
    columns: Callable[[str, dict[str, Any]], tuple[np.ndarray, int] | None] | None = None
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]] | None = None

    def merged_part(self, part: str) -> tuple[str, int, int] | None:
        """(HF name under ``model.layers.<i>.``, position, number of parts) of a GGUF part
        of a merged tensor, else None."""
        for name, parts in self.merged:
            if part in parts:
                return name, parts.index(part), len(parts)
        return None


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM"),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", dict(_GEMMA_BLOCK), norm_shift=1.0),
    "gemma3": GGUFArch("gemma3_text", "Gemma3ForCausalLM", dict(_GEMMA_BLOCK), norm_shift=1.0),
    "phi3": GGUFArch("phi3", "Phi3ForCausalLM", dict(_PHI3_BLOCK)),
    "olmo2": GGUFArch("olmo2", "Olmo2ForCausalLM", dict(_OLMO2_BLOCK)),
    "granite": GGUFArch("granite", "GraniteForCausalLM", permute_qk=True),
    "starcoder2": GGUFArch("starcoder2", "Starcoder2ForCausalLM", dict(_STARCODER2_BLOCK)),
    # Quantized q/k keep their stored rows: GLM-4's model reorders the fused q/k/v output instead.
    "glm4": GGUFArch("glm4", "Glm4ForCausalLM", dict(_GLM4_BLOCK)),
    "smollm3": GGUFArch("smollm3", "SmolLM3ForCausalLM", permute_qk=True),
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", dict(_QWEN_MOE_BLOCK), experts=dict(_QWEN_EXPERTS)),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", dict(_QWEN_MOE_BLOCK), experts=dict(_QWEN_EXPERTS)),
    "deepseek2": GGUFArch("deepseek_v2", "DeepseekV2ForCausalLM", dict(_DEEPSEEK2_BLOCK), experts=dict(_QWEN_EXPERTS)),
}

#: A ``llama`` file with expert tensors is Mixtral (llama.cpp has no separate name for it).
MIXTRAL = GGUFArch(
    "mixtral",
    "MixtralForCausalLM",
    dict(_MIXTRAL_BLOCK),
    permute_qk=True,
    experts=dict(_MIXTRAL_EXPERTS),
    expert_prefix="block_sparse_moe.experts",
)


def expert_target(arch: GGUFArch, layer: int, part: str, expert: int) -> str:
    """HF name of expert ``expert``'s slice of stacked tensor ``blk.<layer>.<part>.weight``."""
    return f"model.layers.{layer}.{arch.expert_prefix}.{expert}.{arch.experts[part]}.weight"


class Metadata:
    """The architecture's metadata keys (``<arch>.<key>``) of one file, with its tensor names.

    refuse(feature): raise naming a feature the file uses that pagedserve does not implement.
    """

    def __init__(
        self,
        arch: str,
        metadata: dict[str, Any],
        tensor_names: set[str],
        where: str,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.arch, self.metadata, self.names, self.where = arch, metadata, tensor_names, where
        #: Stored (numpy-order) shape of each tensor, by GGUF name.
        self.shapes = shapes or {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def refuse(self, feature: str) -> None:
        raise ValueError(f"GGUF file {self.where} uses {feature}, which pagedserve does not implement.")

    def num_layers(self) -> int:
        return int(self.get("block_count", 0))

    def layers_with(self, part: str) -> list[int]:
        return [i for i in range(self.num_layers()) if f"blk.{i}.{part}.weight" in self.names]


def _swa_layer_types(meta: Metadata, default_pattern: int) -> list[str]:
    """llama.cpp's sliding-window layers: the ``sliding_window_pattern`` array (one bool per
    layer) or period, else the family's period (the last layer of each period is global)."""
    pattern = meta.get("attention.sliding_window_pattern", default_pattern)
    n = meta.num_layers()
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            meta.refuse(f"a sliding_window_pattern of {len(pattern)} entries for {n} layers")
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        flags = [period == 0 or i % period < period - 1 for i in range(n)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _gemma_scalar(meta: Metadata, base: dict[str, Any], big_model_layers: int) -> float:
    """Gemma's query_pre_attn_scalar is not stored: llama.cpp uses hidden/heads for the
    27B models (recognised by their layer count) and head_dim otherwise."""
    if meta.num_layers() == big_model_layers:
        return base["hidden_size"] / base["num_attention_heads"]
    return float(base["head_dim"])


def _gemma2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp's defaults when a file omits them (Gemma 2's published values).
        "attn_logit_softcapping": float(meta.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.get("final_logit_softcapping", 30.0)),
        "sliding_window": int(meta.get("attention.sliding_window", 4096)),
        "layer_types": _swa_layer_types(meta, 2),
        "query_pre_attn_scalar": _gemma_scalar(meta, base, 46),
    }


def _gemma3(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    window = int(meta.get("attention.sliding_window", 0))
    n = meta.num_layers()
    types = _swa_layer_types(meta, 6) if window > 0 else ["full_attention"] * n
    final_cap = meta.get("final_logit_softcapping")
    full = {"rope_type": "default", "rope_theta": base["rope_theta"]}
    if base["rope_scaling"] is not None:
        full.update(base["rope_scaling"])
    local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": float(final_cap) if final_cap else None,
        "sliding_window": window or None,
        "layer_types": types,
        "query_pre_attn_scalar": _gemma_scalar(meta, base, 62),
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
    }


def _rotary_fraction(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    dims = meta.get("rope.dimension_count")
    return {"partial_rotary_factor": int(dims) / base["head_dim"] if dims is not None else 1.0}


def _phi3(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & meta.names:
        meta.refuse("longrope scaling (rope_factors_long/short tensors)")
    window = int(meta.get("attention.sliding_window", 0))  # 0: none (Phi-4)
    original = meta.get("rope.scaling.original_context_length")
    out = {**_rotary_fraction(meta, base), "sliding_window": window or None}
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _olmo2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    if meta.get("attention.sliding_window"):
        meta.refuse("sliding-window attention under architecture 'olmo2' (OLMo 3)")
    return {}


def _granite(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, hf_key in (
        ("attention.scale", "attention_multiplier"),
        ("embedding_scale", "embedding_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("logit_scale", "logits_scaling"),
    ):
        value = meta.get(key)
        if value is not None:
            out[hf_key] = float(value)
    return out


def _starcoder2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    window = meta.get("attention.sliding_window")
    return {
        "norm_epsilon": float(meta.get("attention.layer_norm_epsilon", 1e-5)),
        "use_bias": "blk.0.attn_q.bias" in meta.names,
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
    }


def _glm4(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    if meta.get("rope.dimension_sections") is not None:
        meta.refuse("M-RoPE (rope.dimension_sections, GLM-4V)")
    return _rotary_fraction(meta, base)


def _smollm3(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # Not stored: llama.cpp skips RoPE on every fourth layer (SmolLM3's no_rope_layer_interval).
    n = meta.num_layers()
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)], "use_sliding_window": False}


def _moe(meta: Metadata, base: dict[str, Any], renormalize: bool) -> dict[str, Any]:
    gating = meta.get("expert_gating_func")
    if gating is not None and int(gating) != 1:  # 1: softmax (gguf.ExpertGatingFuncType)
        meta.refuse(f"expert gating function {int(gating)} (only softmax is implemented)")
    scale = meta.get("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        meta.refuse(f"expert_weights_scale={float(scale)}")
    sparse = set(meta.layers_with("ffn_gate_inp"))
    return {
        "num_experts": int(meta.get("expert_count", 0)),
        "num_experts_per_tok": int(meta.get("expert_used_count", 0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", renormalize)),
        "mlp_only_layers": [i for i in range(meta.num_layers()) if i not in sparse],
        "decoder_sparse_step": 1,
    }


def _qwen2moe(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp does not renormalise Qwen2-MoE's top-k weights (as transformers' default).
    out = _moe(meta, base, renormalize=False)
    out["moe_intermediate_size"] = int(meta.get("expert_feed_forward_length", base["intermediate_size"]))
    shared = meta.get("expert_shared_feed_forward_length")
    out["shared_expert_intermediate_size"] = int(shared) if shared is not None else base["intermediate_size"]
    return out


def _qwen3moe(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    out = _moe(meta, base, renormalize=True)  # llama.cpp always renormalises Qwen3-MoE
    out["moe_intermediate_size"] = int(meta.get("expert_feed_forward_length", base["intermediate_size"]))
    return out


def _mixtral(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_local_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.get("expert_used_count", 2)),
        "sliding_window": None,
    }


def _deepseek2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    """MLA and MoE sizes.  llama.cpp stores the attention as MQA over the latent
    (head_count_kv 1, key_length kv_lora_rank + rope): the per-head sizes are the ``*_mla``
    keys (older converters, which keep kv_b_proj whole, wrote them as key/value_length)."""
    rope = int(meta.get("rope.dimension_count", 0))
    if meta.get("attention.key_length_mla") is not None:
        qk, v = int(meta.get("attention.key_length_mla")), int(meta.get("attention.value_length_mla"))
    elif "blk.0.attn_k_b.weight" in meta.names:
        meta.refuse("split attn_k_b/attn_v_b tensors without attention.key_length_mla")
    else:
        qk, v = int(meta.get("attention.key_length")), int(meta.get("attention.value_length"))
    both = sorted(set(meta.layers_with("attn_kv_b")) & set(meta.layers_with("attn_k_b")))
    if both:
        meta.refuse(f"both attn_kv_b and its split attn_k_b/attn_v_b in layer {both[0]}")
    gating = meta.get("expert_gating_func")
    if gating is not None and int(gating) not in (0, 1):  # 0: unset (softmax for deepseek2), 1: softmax
        meta.refuse(f"expert gating function {int(gating)} (only softmax is implemented)")
    if any(".exp_probs_b." in name for name in meta.names):
        meta.refuse("expert score correction biases (exp_probs_b, DeepSeek-V3's noaux_tc routing)")
    groups, used = int(meta.get("expert_group_count", 1) or 1), int(meta.get("expert_group_used_count", 0) or 0)
    out: dict[str, Any] = {
        "num_key_value_heads": base["num_attention_heads"],
        "head_dim": rope,  # as transformers writes it; the model sizes its cache from the MLA head sizes
        "q_lora_rank": int(meta.get("attention.q_lora_rank")) if meta.get("attention.q_lora_rank") else None,
        "kv_lora_rank": int(meta.get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v,
        "first_k_dense_replace": int(meta.get("leading_dense_block_count", 0)),
        "moe_intermediate_size": int(meta.get("expert_feed_forward_length", base["intermediate_size"])),
        "n_routed_experts": int(meta.get("expert_count", 0)),
        "num_experts_per_tok": int(meta.get("expert_used_count", 0)),
        "n_shared_experts": int(meta.get("expert_shared_count", 0)),
        "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "scoring_func": "softmax",
        "moe_layer_freq": 1,
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups if groups > 1 else None,
        "topk_group": used if groups > 1 else None,
    }
    scaling = base["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "yarn":
        log_mul = meta.get("rope.scaling.yarn_log_multiplier")
        if log_mul is None:
            meta.refuse("YaRN without rope.scaling.yarn_log_multiplier (DeepSeek's mscale_all_dim)")
        # The converter writes 0.1 * mscale_all_dim; DeepSeek's configs have mscale equal to it.
        m = float(log_mul) / 0.1
        out["rope_scaling"] = {**scaling, "mscale": m, "mscale_all_dim": m}
    return out


ARCH_CONFIG: dict[str, Callable[[Metadata, dict[str, Any]], dict[str, Any]]] = {
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "granite": _granite,
    "starcoder2": _starcoder2,
    "glm4": _glm4,
    "smollm3": _smollm3,
    "qwen2_moe": _qwen2moe,
    "qwen3_moe": _qwen3moe,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek2,
}


def arch_config(arch: GGUFArch, meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (the generic config) completed with ``arch``'s own entries."""
    extra = arch.config or ARCH_CONFIG.get(arch.model_type)
    return {**base, **extra(meta, base)} if extra is not None else base
