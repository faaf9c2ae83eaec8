"""Write a transformers model as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does.

Independent of pagedserve's loader: tensor names come from the ``gguf`` package's own
name map; the rewrites are the converter's (Q/K row interleave for Llama-derived classes,
Gemma norms stored as 1 + w, experts stacked ``[n_expert, rows, cols]`` with gate and up
split, Gemma 2's LM head dropped), and the metadata keys those its ``set_gguf_parameters``
writes for each family.  Linear weights may be quantized (``gguf.quants``) the way
``--outtype q8_0`` does: 1-D tensors, routers and rows that are not whole blocks stay F32.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import gguf
import numpy as np
import torch

#: Families whose converter class derives from llama.cpp's LlamaModel (Q/K rows interleaved).
LLAMA_DERIVED = ("llama", "granite", "smollm3", "granitehybrid", "nemotron_h")
#: Hybrid families (recurrent-state layers): their own metadata and tensor rewrites.
HYBRID = ("qwen35", "qwen35moe", "qwen3next", "lfm2", "granitehybrid", "nemotron_h", "jamba")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of a q/k projection (or bias), as LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(hp: dict[str, Any]) -> dict[str, Any]:
    params = hp.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _metadata(writer: Any, arch: str, hp: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters plus the family's additions."""
    if arch in HYBRID:
        _hybrid_metadata(writer, arch, hp)
        return
    w = writer
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    # DeepseekV2Model: MLA is written as MQA over the latent (one KV head).
    w.add_head_count_kv(1 if arch == "deepseek2" else hp["num_key_value_heads"])
    rope = _rope(hp)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_freq_base(rope["rope_theta"])
    local = (hp.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:
        w.add_rope_freq_base_swa(local["rope_theta"])
    if hp.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("norm_epsilon") is not None:
        w.add_layer_norm_eps(hp["norm_epsilon"])
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None and arch not in ("granite", "phi3", "deepseek2"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    if arch in LLAMA_DERIVED:
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"] if arch == "granite" else head_dim)
    if arch == "granite":
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    if arch == "gemma3":
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    if arch == "phi3":
        rot = int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // hp["num_attention_heads"]
        w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        w.add_rope_dimension_count(rot)
        w.add_sliding_window(hp.get("sliding_window") or 0)
    if arch == "glm4":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    if arch == "deepseek2":
        _deepseek2_metadata(w, hp, rope)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if hp.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])


def _hybrid_metadata(w: Any, arch: str, hp: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters with what Qwen3NextModel (qwen35), LFM2Model and
    GraniteHybridModel change and add."""
    n = hp["num_hidden_layers"]
    rope = _rope(hp)
    w.add_block_count(n)
    w.add_context_length(2**20 if arch in ("granitehybrid", "nemotron_h") else hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps") or hp.get("norm_eps") or hp["layer_norm_epsilon"])
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        head_dim = hp["head_dim"]
        if hp.get("intermediate_size") is not None:
            w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if arch in ("qwen35moe", "qwen3next"):
            w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
        w.add_ssm_state_size(hp["linear_key_head_dim"])
        w.add_ssm_group_count(hp["linear_num_key_heads"])
        w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
        w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in hp["layer_types"]])
        w.add_full_attention_interval(hp.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
        if arch != "qwen3next":
            w.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin's default
    if arch == "lfm2":
        w.add_head_count_kv([hp["num_key_value_heads"] if t != "conv" else 0 for t in hp["layer_types"]])
        w.add_vocab_size(hp["vocab_size"])
        w.add_shortconv_l_cache(hp["conv_L_cache"])
        ff = hp.get("block_ff_dim") or hp["intermediate_size"]
        if hp.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            if hp.get("block_ffn_dim_multiplier") is not None:
                ff = int(hp["block_ffn_dim_multiplier"] * ff)
            m = hp.get("block_multiple_of", 256)
            ff = m * ((ff + m - 1) // m)
        w.add_feed_forward_length(ff)
    if arch == "granitehybrid":
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_vocab_size(-(hp["vocab_size"] // -8) * 8)  # Mamba2Model.set_vocab pads to 8
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
        if hp.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(hp["shared_intermediate_size"])
        d_inner = int(hp["mamba_expand"] * hp["hidden_size"])
        w.add_ssm_conv_kernel(hp["mamba_d_conv"])
        w.add_ssm_state_size(hp["mamba_d_state"])
        w.add_ssm_group_count(hp["mamba_n_groups"])
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_time_step_rank(hp["mamba_n_heads"])
        # transformers 5 spells Granite's "attention" / "mamba" as full_attention / linear_attention
        attention = ("attention", "full_attention")
        w.add_head_count_kv([hp["num_key_value_heads"] if t in attention else 0 for t in hp["layer_types"]])
        w.add_rope_scaling_finetuned(False)
    if arch == "jamba":  # JambaModel.set_gguf_parameters
        n = hp["num_hidden_layers"]
        off, per = hp["attn_layer_offset"], hp["attn_layer_period"]
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count_kv([hp["num_key_value_heads"] if i >= off and (i - off) % per == 0 else 0 for i in range(n)])
        w.add_ssm_conv_kernel(hp["mamba_d_conv"])
        w.add_ssm_inner_size(hp["mamba_expand"] * hp["hidden_size"])
        w.add_ssm_state_size(hp["mamba_d_state"])
        w.add_ssm_time_step_rank(hp["mamba_dt_rank"])
    if arch == "nemotron_h":  # NemotronHModel over GraniteHybridModel (no multipliers in its config)
        kinds = hp["layers_block_type"]
        w.add_vocab_size(-(hp["vocab_size"] // -8) * 8)
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
        w.add_ssm_conv_kernel(hp["conv_kernel"])
        w.add_ssm_state_size(hp["ssm_state_size"])
        w.add_ssm_group_count(hp["n_groups"])
        w.add_ssm_inner_size(hp["mamba_num_heads"] * hp["mamba_head_dim"])
        w.add_ssm_time_step_rank(hp["mamba_num_heads"])
        w.add_head_count_kv([hp["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
        w.add_rope_scaling_finetuned(False)
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        # As for a hybrid_override_pattern string ('-': MLP), what the published checkpoints carry.
        w.add_feed_forward_length([hp["intermediate_size"] if k == "mlp" else 0 for k in kinds])


def _tile(a: np.ndarray, k: int, r: int, d: int, axis: int = 0) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head ->
    tiled, along ``axis``."""
    if r == 1:
        return a
    order = np.arange(k * r * d).reshape(k, r, d).transpose(1, 0, 2).reshape(-1)
    return np.ascontiguousarray(np.take(a, order, axis=axis))


def _hybrid_tensor(name: str, a: np.ndarray, arch: str, hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """The converter's modify_tensors for the hybrid families: (HF-like or GGUF name, values)."""
    if arch in ("qwen35", "qwen35moe") and ".linear_attn." in name:
        k, v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        r, dk, dv = v // k, hp["linear_key_head_dim"], hp["linear_value_head_dim"]
        if name.endswith("in_proj_qkv.weight"):
            a = np.concatenate([a[: 2 * k * dk], _tile(a[2 * k * dk :], k, r, dv)])
        elif name.endswith("in_proj_z.weight"):
            a = _tile(a, k, r, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
            a = _tile(a, k, r, 1)
        elif name.endswith("conv1d.weight"):
            a = a.squeeze(1)
            a = np.concatenate([a[: 2 * k * dk], _tile(a[2 * k * dk :], k, r, dv)])
        elif name.endswith("out_proj.weight"):
            a = _tile(a, k, r, dv, axis=1)
        if name.endswith(".A_log"):
            a = -np.exp(a)
        if name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
    if arch == "qwen3next" and ".linear_attn." in name:  # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            a = -np.exp(a)
        elif name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        elif name.endswith("conv1d.weight"):
            a = a.squeeze()
        elif name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> q, k, v of all heads; z
            k, v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
            dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
            sizes = [dk, dk, v // k * dv, v // k * dv]
            per_head = a.reshape(k, sum(sizes), a.shape[-1])
            q, kk, vv, z = np.split(per_head, np.cumsum(sizes)[:-1], axis=1)
            flat = [t.reshape(-1, a.shape[-1]) for t in (q, kk, vv, z)]
            layer = name.split(".")[2]
            return [
                (f"blk.{layer}.attn_qkv.weight", np.concatenate(flat[:3])),
                (f"blk.{layer}.attn_gate.weight", flat[3]),
            ]
    if arch.startswith("qwen3") and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        a = a + np.float32(1.0)
    if arch == "lfm2" and name.endswith("conv.conv.weight"):
        a = a.squeeze(1)
    if arch == "jamba":  # JambaModel.modify_tensors
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("feed_forward.experts.gate_up_proj"):  # stacked in memory, split like the converter
            half = a.shape[-2] // 2
            return [
                (f"blk.{layer}.ffn_gate_exps.weight", a[:, :half]),
                (f"blk.{layer}.ffn_up_exps.weight", a[:, half:]),
            ]
        if name.endswith("feed_forward.experts.down_proj"):
            return [(f"blk.{layer}.ffn_down_exps.weight", a)]
        if name.endswith("mamba.conv1d.weight"):
            a = a.squeeze()
        if name.endswith(".A_log"):
            a = -np.exp(a)
    if arch == "nemotron_h":  # the checkpoint's names on disk: backbone.*
        name = "backbone." + name[len("model.") :] if name.startswith("model.") else name
        if ".mixer." in name and name.endswith(("conv1d.weight", ".A_log", ".D", "mixer.norm.weight", ".dt_bias")):
            if name.endswith("conv1d.weight"):
                a = a.squeeze()
            elif name.endswith((".A_log", ".D")):
                a = a.reshape(*a.shape, 1)
            elif name.endswith("mixer.norm.weight"):
                a = a.reshape(hp["n_groups"], -1)
            if name.endswith(".A_log"):
                a = -np.exp(a)
            if name.endswith(".dt_bias"):
                name = name[: -len("dt_bias")] + "dt_proj.bias"
    if arch == "granitehybrid":
        # The checkpoint's names on disk (transformers renames them in memory).
        for memory, disk in (
            ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
            ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
            ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
        ):
            if name.endswith(memory):
                name = name[: -len(memory)] + disk
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        experts = bool(hp.get("num_local_experts"))
        if ".mamba." in name:  # Mamba2Model.modify_tensors
            if name.endswith("conv1d.weight"):
                a = a.squeeze()
            elif name.endswith((".A_log", ".D")):
                a = a.reshape(*a.shape, 1)
            elif name.endswith("mamba.norm.weight"):
                g = hp["mamba_n_groups"]
                a = a.reshape(g, -1)
            if name.endswith(".A_log"):
                a = -np.exp(a)
            if name.endswith(".dt_bias"):
                name = name[: -len("dt_bias")] + "dt_proj.bias"
        elif name.endswith("block_sparse_moe.input_linear.weight"):  # GraniteMoeModel: gate, up
            half = a.shape[-2] // 2
            return [
                (f"blk.{layer}.ffn_gate_exps.weight", a[..., :half, :]),
                (f"blk.{layer}.ffn_up_exps.weight", a[..., half:, :]),
            ]
        elif name.endswith("shared_mlp.input_linear.weight"):
            half, sfx = a.shape[-2] // 2, "_shexp" if experts else ""
            return [(f"blk.{layer}.ffn_gate{sfx}.weight", a[:half]), (f"blk.{layer}.ffn_up{sfx}.weight", a[half:])]
        elif name.endswith("shared_mlp.output_linear.weight") and not experts:
            return [(f"blk.{layer}.ffn_down.weight", a)]
    return [(name, np.ascontiguousarray(a))]


def _deepseek2_metadata(w: Any, hp: dict[str, Any], rope: dict[str, Any]) -> None:
    """DeepseekV2Model.set_gguf_parameters: the latent sizes, MLA head sizes, MoE counts."""
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    rank, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(a: np.ndarray, hp: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """DeepseekV2Model.modify_tensors: kv_b_proj -> k_b [heads, rank, nope] (transposed), v_b [heads, v, rank]."""
    nope, v = hp["qk_nope_head_dim"], hp["v_head_dim"]
    kv_b = a.reshape(hp["num_attention_heads"], nope + v, a.shape[-1])
    return np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])


def _tokenizer(writer: Any, folder: pathlib.Path, vocab_size: int) -> None:
    """The byte-level tokenizer of ``folder`` as a gpt2 vocabulary (one merge so BPE has some)."""
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + ["ĠĠ"]
    assert len(tokens) == vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(model: Any, arch: str, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """HF name -> float32 array after the converter's rewrites (names still HF-like);
    ``split_kv_b``: DeepSeek-V2's kv_b_proj as current converters write it (attn_k_b and
    attn_v_b), else whole as older ones did (attn_kv_b)."""
    hp = {**model.config.to_dict(), "num_hidden_layers": model.config.num_hidden_layers}
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == "lm_head.weight" and (hp.get("tie_word_embeddings") or arch == "gemma2"):
            continue
        if arch in LLAMA_DERIVED and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = llama_cpp_permute(a, hp["num_attention_heads"])
        if arch in LLAMA_DERIVED and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = llama_cpp_permute(a, hp["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * I, H]: split like the converter
            half = a.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj.weight")] = np.ascontiguousarray(a[:, :half])
            out[name.replace("gate_up_proj", "up_proj.weight")] = np.ascontiguousarray(a[:, half:])
            continue
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        if arch == "deepseek2" and split_kv_b and name.endswith("kv_b_proj.weight"):
            k_b, v_b = _split_kv_b(a, hp)
            out[name.replace("kv_b_proj", "k_b_proj")], out[name.replace("kv_b_proj", "v_b_proj")] = k_b, v_b
            continue
        if arch in HYBRID:
            out.update(_hybrid_tensor(name, a, arch, hp))
            continue
        out[name] = a
    return out


def _gguf_name(name_map: Any, hf_name: str, arch: str) -> str:
    if hf_name.startswith("blk."):  # named by the converter itself
        return hf_name
    mapped = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, hf_name
    return mapped


def _stays_f32(gguf_name: str, values: np.ndarray, block: int) -> bool:
    """The converter's prepare_tensors: 1-D tensors, norms, routers, convolutions and
    tensors not named ``*.weight`` stay F32; so do rows that are not whole blocks."""
    return (
        values.ndim < 2
        or values.shape[-1] % block != 0
        or gguf_name.endswith("_norm.weight")
        or not gguf_name.endswith(".weight")
        or any(p in gguf_name for p in ("ffn_gate_inp", "ssm_conv1d", "shortconv.conv"))
    )


def write_gguf_like_llama_cpp(
    path: pathlib.Path,
    model: Any,
    arch: str,
    linear_type: str = "F32",
    extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    split_kv_b: bool = True,
) -> pathlib.Path:
    """Convert ``model`` (a transformers causal LM whose folder holds tokenizer.json) to ``path``.

    linear_type: ggml type of every weight with two or more dimensions whose rows are whole
    blocks (embedding and LM head included), except routers; the rest stay F32.
    extra, extra_tensors: further metadata (key without the ``<arch>.`` prefix -> value)
    and F32 tensors (GGUF name -> values), for files using features not implemented.
    split_kv_b: see ``_tensors``.
    """
    hp = {**model.config.to_dict(), "num_hidden_layers": model.config.num_hidden_layers}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    _metadata(writer, arch, hp)
    _tokenizer(writer, path.parent, hp["vocab_size"])
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, hp["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[linear_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for hf_name, values in _tensors(model, arch, split_kv_b).items():
        gguf_name = _gguf_name(name_map, hf_name, arch)
        if not _stays_f32(gguf_name, values, block):
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantization_roundtrip(model: Any, arch: str, linear_type: str) -> None:
    """Replace, in place, each of ``model``'s weights that the writer quantizes by its
    dequantized value (``gguf.quants``), so transformers runs what the file holds."""
    if linear_type == "F32":
        return
    qtype = gguf.GGMLQuantizationType[linear_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            router = name.endswith(
                ("mlp.gate.weight", "shared_expert_gate.weight", "router.weight", "router.layer.weight")
            )
            conv = name.endswith(("conv1d.weight", "conv.conv.weight"))
            if p.dim() < 2 or p.shape[-1] % block or router or conv:
                continue
            a = p.detach().float().numpy()
            # Blocks run along rows, so a fused gate_up quantizes as its two halves would.
            back = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
            p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(a.shape)))
