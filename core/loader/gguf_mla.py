"""DeepSeek-V2's ``kv_b_proj`` from the two tensors current llama.cpp converters write.

``kv_b_proj`` ([heads * (qk_nope + v), kv_lora_rank], each head's key rows then its value
rows) expands the attention latent.  llama.cpp's converter used to store it as it is
(``attn_kv_b``); newer ones split it for llama.cpp's absorbed MLA into ``attn_k_b``
(numpy shape ``[heads, kv_lora_rank, qk_nope]``: each head's key part, transposed) and
``attn_v_b`` (``[heads, v, kv_lora_rank]``).  A transposed matrix cannot keep its
quantized blocks (they run along the other dimension), so the two are dequantized and
put back together here, whatever their stored type; an ``attn_kv_b`` keeps its blocks.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SPLIT_KV_B_PARTS", "merge_kv_b", "merged_kv_b_shape"]

#: GGUF block parts of the split layout, in the order :func:`merge_kv_b` takes them.
SPLIT_KV_B_PARTS = ("attn_k_b", "attn_v_b")


def merged_kv_b_shape(k_b: tuple[int, ...], v_b: tuple[int, ...], where: str) -> tuple[int, int]:
    """``kv_b_proj``'s shape [heads * (nope + v), kv_lora_rank] from the numpy shapes of
    ``attn_k_b`` [heads, rank, nope] and ``attn_v_b`` [heads, v, rank]; a ValueError
    naming ``where`` (the layer) when the two disagree."""
    if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
        raise ValueError(
            f"{where}: attn_k_b {list(k_b)} and attn_v_b {list(v_b)} are not the split of one kv_b_proj "
            "([heads, kv_lora_rank, qk_nope] and [heads, v, kv_lora_rank])"
        )
    heads, rank, nope = k_b
    return heads * (nope + v_b[1]), rank


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray, where: str) -> np.ndarray:
    """float32 ``attn_k_b`` [heads, rank, nope] and ``attn_v_b`` [heads, v, rank] ->
    ``kv_b_proj`` [heads * (nope + v), rank] (per head: the key rows, then the value rows)."""
    rows, rank = merged_kv_b_shape(k_b.shape, v_b.shape, where)
    merged = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(merged.reshape(rows, rank), dtype=np.float32)
