"""What a Gemma 4 text ``config.json`` says about each layer, read as transformers reads
it (``Gemma4TextConfig``): its attention type, head size and KV heads, which layers
reuse an earlier layer's keys and values (``num_kv_shared_layers``), and the checks of
the values pagedserve does not implement."""

from __future__ import annotations

from typing import Any

from pagedserve.models.layers import GATED_ACTIVATIONS

__all__ = ["layer_types", "layer_shapes", "kv_sources", "check_gemma4_config", "MOE_ACTIVATIONS"]

#: ``hidden_activation`` -> the ``fused_moe`` op's activation name (its "gelu" is the tanh form).
MOE_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu", "silu": "silu"}


def layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, or transformers' default (5 sliding : 1 full); the last layer is
    always full attention, as transformers forces it."""
    types = list(
        hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    )
    if types:
        types[-1] = "full_attention"
    return types


def layer_shapes(hf: dict[str, Any], num_layers: int) -> list[tuple[int, int]]:
    """(head_dim, kv_heads) of every layer: ``per_layer_config`` overrides (keyed by layer
    index, as transformers writes them) or ``global_head_dim`` / ``num_global_key_value_heads``
    on the full-attention layers."""
    head = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    per_layer = hf.get("per_layer_config")
    types = layer_types(hf, num_layers)
    out = []
    for i, kind in enumerate(types):
        if isinstance(per_layer, dict):
            over = per_layer.get(str(i)) or per_layer.get(i) or {}
        elif kind == "full_attention":
            over = {"head_dim": hf.get("global_head_dim", 512)}
            if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
                over["num_key_value_heads"] = hf["num_global_key_value_heads"]
        else:
            over = {}
        out.append((int(over.get("head_dim") or head), int(over.get("num_key_value_heads") or kv)))
    return out


def kv_sources(hf: dict[str, Any], num_layers: int) -> list[int | None]:
    """Per layer, the earlier layer whose keys and values it reads instead of its own
    (None: it computes and caches its own).  transformers' ``kv_sharing_modes``: the last
    ``num_kv_shared_layers`` layers each read the last layer of their attention type
    before them.  ValueError when every layer is shared (an assistant model that reads
    another model's cache) or a shared layer's type has no such layer."""
    shared = int(hf.get("num_kv_shared_layers") or 0)
    if not shared:
        return [None] * num_layers
    if shared >= num_layers:
        raise ValueError(
            f"num_kv_shared_layers={shared} of {num_layers} layers: every layer reads keys and values another "
            "model computed (a drafting assistant); not supported"
        )
    types = layer_types(hf, num_layers)
    first = num_layers - shared
    last_of: dict[str, int] = {t: i for i, t in enumerate(types[:first])}
    out: list[int | None] = [None] * first
    for i in range(first, num_layers):
        if types[i] not in last_of:
            raise ValueError(
                f"layer {i} ({types[i]}) shares the KV of an earlier {types[i]} layer (num_kv_shared_layers={shared}) "
                "but none of the first layers is one"
            )
        out.append(last_of[types[i]])
    return out


def check_gemma4_config(hf: dict[str, Any], num_layers: int, num_heads: int, num_kv_heads: int) -> None:
    """ValueError naming any value of a Gemma 4 text config not implemented here."""

    def refuse(what: str) -> None:
        raise ValueError(f"Gemma4ForCausalLM: {what} is not supported")

    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GATED_ACTIVATIONS:
        refuse(f"hidden_activation {act!r}")
    if hf.get("use_bidirectional_attention"):
        refuse(f"use_bidirectional_attention={hf['use_bidirectional_attention']!r}")
    shapes = layer_shapes(hf, num_layers)
    for i, (_, kv) in enumerate(shapes):
        if num_heads % kv or num_kv_heads % kv:
            refuse(f"layer {i}'s {kv} KV heads with {num_heads} heads and {num_kv_heads} KV heads elsewhere")
    for i, src in enumerate(kv_sources(hf, num_layers)):
        if src is not None and shapes[i][0] != shapes[src][0]:
            refuse(f"layer {i} (head size {shapes[i][0]}) reading the KV of layer {src} (head size {shapes[src][0]})")
    per_layer = int(hf.get("hidden_size_per_layer_input") or 0)
    if per_layer:
        ple_vocab = int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"])
        if ple_vocab < int(hf["vocab_size"]):
            refuse(f"vocab_size_per_layer_input={ple_vocab} below vocab_size={hf['vocab_size']}")
    if hf.get("enable_moe_block"):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not hf.get(key):
                refuse(f"enable_moe_block=true without {key}")
        if act not in MOE_ACTIVATIONS:
            refuse(f"the MoE block with hidden_activation {act!r} (supported: {', '.join(MOE_ACTIVATIONS)})")
