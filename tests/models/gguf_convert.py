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
LLAMA_DERIVED = ("llama", "granite", "smollm3")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of a q/k projection (or bias), as LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(hp: dict[str, Any]) -> dict[str, Any]:
    params = hp.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _metadata(writer: Any, arch: str, hp: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters plus the family's additions."""
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
    hp = model.config.to_dict()
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
        out[name] = a
    return out


def _gguf_name(name_map: Any, hf_name: str, arch: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    mapped = name_map.get_name(stem)
    assert mapped is not None, hf_name
    return f"{mapped}.{suffix}"


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
    hp = model.config.to_dict()
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
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hp["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[linear_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for hf_name, values in _tensors(model, arch, split_kv_b).items():
        gguf_name = _gguf_name(name_map, hf_name, arch)
        router = "ffn_gate_inp" in gguf_name
        if values.ndim >= 2 and values.shape[-1] % block == 0 and not router:
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
            router = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
            if p.dim() < 2 or p.shape[-1] % block or router:
                continue
            a = p.detach().float().numpy()
            # Blocks run along rows, so a fused gate_up quantizes as its two halves would.
            back = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
            p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(a.shape)))
