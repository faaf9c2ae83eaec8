"""Tiny checkpoints written on the spot for the loader-error and mutation tests.

Both writers are independent of pagedserve's readers: the safetensors folder comes from
``safetensors``/``tokenizers``, the GGUF from gguf-py's ``GGUFWriter``. The weights are random
(never zeros) and the GGUF carries a byte-level BPE tokenizer, so both load into an engine.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from pagedserve.testing.tiny_model import TinyLlamaSpec, write_byte_tokenizer, write_llama_safetensors

__all__ = ["GGUF_CONFIG", "write_tiny_gguf", "write_tiny_safetensors", "edit_config"]

# Rows of 32 elements: Q8_0 blocks (32 wide) fit, so the file holds quantized tensors too.
GGUF_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def write_tiny_safetensors(folder: pathlib.Path, spec: TinyLlamaSpec | None = None) -> pathlib.Path:
    """A Hugging Face folder: config.json, model.safetensors, tokenizer.json (+ its config)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(folder)
    write_llama_safetensors(
        folder,
        vocab,
        spec or TinyLlamaSpec(hidden_size=64, intermediate_size=128, head_dim=32, max_position_embeddings=256),
    )
    return folder


def edit_config(folder: pathlib.Path, **changes: Any) -> None:
    """Rewrite ``config.json`` with ``changes`` (a None value deletes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _byte_vocab() -> tuple[list[str], list[int]]:
    from pagedserve.loader.gguf_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(bytes_to_unicode().values()) + ["he", "ll"]
    return tokens, [3] * len(specials) + [1] * (len(tokens) - len(specials))


def write_tiny_gguf(
    path: pathlib.Path, seed: int = 0, metadata: dict[str, Any] | None = None, **config: Any
) -> pathlib.Path:
    """A Llama GGUF with random weights (F32 norms, Q8_0 and F16 matrices) and a tokenizer.

    ``config`` overrides GGUF_CONFIG's values in the metadata only: the tensors keep
    GGUF_CONFIG's shapes, so an override makes the metadata lie. ``metadata`` adds
    ``key: (value, GGUFValueType)`` pairs.
    """
    import gguf

    cfg = {**GGUF_CONFIG, **config}
    shape = GGUF_CONFIG
    tokens, types = _byte_vocab()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_rope_dimension_count(shape["hidden_size"] // shape["num_attention_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], len(tokens)
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def add(name: str, rows: int, cols: int | None, qtype: str = "F32") -> None:
        values = rng.standard_normal((rows, cols) if cols else (rows,)).astype(np.float32)
        values = values * 0.1 if cols else 1.0 + 0.1 * values
        kind = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", vocab, h, "F16")
    for i in range(shape["num_hidden_layers"]):
        add(f"blk.{i}.attn_norm.weight", h, None)
        add(f"blk.{i}.attn_q.weight", h, h, "Q8_0")
        add(f"blk.{i}.attn_k.weight", kv, h, "Q8_0")
        add(f"blk.{i}.attn_v.weight", kv, h, "Q8_0")
        add(f"blk.{i}.attn_output.weight", h, h, "Q8_0")
        add(f"blk.{i}.ffn_norm.weight", h, None)
        add(f"blk.{i}.ffn_gate.weight", inter, h, "Q8_0")
        add(f"blk.{i}.ffn_up.weight", inter, h, "Q8_0")
        add(f"blk.{i}.ffn_down.weight", h, inter, "Q8_0")
    add("output_norm.weight", h, None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
