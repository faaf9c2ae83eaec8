"""Mixture-of-experts MLP over quantized experts, built from the quantized linear ops.

The ``fused_moe`` op multiplies float experts stacked ``[E, ...]``; quantized experts
(load-time int8/w8a8/fp8, GPTQ/AWQ checkpoints, GGUF blocks) stay one :class:`QuantizedWeight` per
expert and run here instead, with the same grouping as the op's reference: tokens
sorted by expert, two GEMMs (each expert weight's own ``apply``, i.e. the platform's
quantized linear op, or ``ops.linear`` for a float one) per active expert, a loop over
active experts and never over tokens, the weighted sum over the top-k accumulated in float32.

A layer's experts may be partly quantized: under tensor parallelism a GGUF ``down_proj``
whose input-column shard is not whole blocks is dequantized (``Decoder._shard_quantized``)
while the row-sharded gate and up keep their blocks.  Those layers keep the per-expert
lists, each weight in the form it loaded in.
"""

from __future__ import annotations

import logging

import torch

from pagedserve.models.layers import linear
from pagedserve.quantization.base import QuantizedWeight

logger = logging.getLogger(__name__)

__all__ = ["prepare_expert_lists", "quantized_experts_moe", "stack_experts"]


def stack_experts(gate_up: list[list], down: list, param, fuse, what: str) -> tuple:
    """A layer's experts as the MoE forward takes them: ``gate_up[e]`` is expert e's
    [gate, up] weights, ``down[e]`` its down weight.  Float experts are stacked into
    ``w13`` [E, 2 * I, H] and ``w2`` [E, H, I] for ``fused_moe``; quantized ones stay one
    :class:`QuantizedWeight` per expert (gate and up fused) for
    :func:`quantized_experts_moe`.  A layer mixing the two (e.g. a GGUF ``down_proj``
    dequantized for its tensor-parallel shard beside kept gate/up blocks) keeps those
    lists too, each weight as it loaded (a gate/up pair mixing the two is fused as floats,
    as :func:`fuse` does); ``what`` names the layer's family in the log line."""
    kinds = {isinstance(t, QuantizedWeight) for t in [*down, *(t for pair in gate_up for t in pair)]}
    if kinds == {False}:
        return param(torch.stack([torch.cat(pair) for pair in gate_up])), param(torch.stack(down))
    if len(kinds) > 1 and what not in _MIXED_LOGGED:
        _MIXED_LOGGED.add(what)
        logger.info(
            "%s: a layer's experts are partly quantized: each expert weight runs in the form it loaded in", what
        )
    return [param(fuse(pair)) for pair in gate_up], [param(t) for t in down]


_MIXED_LOGGED: set[str] = set()


def prepare_expert_lists(ops, w13: list, w2: list) -> tuple[list, list]:
    """Per-expert weights (:func:`stack_experts`' lists) in their prepared form: a
    quantized one's ``prepared()``, a float one through ``ops.prepare_linear_weight``."""

    def prepared(w):
        return w.prepared() if isinstance(w, QuantizedWeight) else ops.prepare_linear_weight(w)

    return [prepared(w) for w in w13], [prepared(w) for w in w2]


def quantized_experts_moe(
    ops,
    x: torch.Tensor,
    w13: list[QuantizedWeight],
    w2: list[QuantizedWeight],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; w13[e] logical [2 * I, H] (gate rows, then up); w2[e] [H, I] (each
    quantized or float);
    topk_weights float32 [T, K]; topk_ids int64 [T, K] -> [T, H] in x's dtype:
    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @ x[t]))."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(w13)).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        h = ops.silu_and_mul(linear(ops, x.index_select(0, rows), w13[expert]))
        y = linear(ops, h, w2[expert])
        out.index_add_(0, rows, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)
