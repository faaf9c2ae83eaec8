"""A step's grammar bitmask: the allowed next tokens of its constrained rows, as data.

The matchers live with the requests in the engine's process.  When a step is planned
(pagedserve.executor.sample_step), :func:`grammar_bitmask` asks each constrained
sampling row's matcher for its allowed tokens and packs them into one int32 tensor; the
step's tail applies it to the logits wherever sampling runs
(:func:`apply_grammar_bitmask`), and the engine advances the matchers with the accepted
tokens afterwards.  Nothing here needs a matcher once the bitmask is built, so the mask
can travel with the step like any other input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GrammarBitmask", "grammar_bitmask", "apply_grammar_bitmask"]


@dataclass
class GrammarBitmask:
    """rows: the sampling rows (indices into the step's sampling requests) that are
    constrained; bitmask int32 ``[len(rows), ceil(vocab / 32)]``: bit ``j % 32`` of word
    ``j // 32`` set when token ``j`` is allowed."""

    rows: list[int]
    bitmask: torch.Tensor


def grammar_bitmask(requests: list, vocab_size: int) -> GrammarBitmask | None:
    """The bitmask of the rows of ``requests`` (one per sampling row) whose grammar
    constrains the next token; None when no row is constrained.  ``vocab_size``: the
    logits' width (which may exceed the tokenizer's vocabulary)."""
    rows = [i for i, r in enumerate(requests) if r.structured is not None and r.structured.constraining]
    if not rows:
        return None
    bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        requests[i].structured.fill_bitmask(bitmask, j)
    return GrammarBitmask(rows, bitmask)


def apply_grammar_bitmask(ops, logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """Set the disallowed logits of ``mask.rows`` to -inf, in place, with the op registry's
    ``apply_token_bitmask``; logits ``[rows, vocab]`` on any device."""
    bitmask = mask.bitmask
    indices = None if len(mask.rows) == logits.shape[0] else torch.tensor(mask.rows, dtype=torch.int64)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = None if indices is None else indices.to(logits.device, non_blocking=True)
    ops.apply_token_bitmask(logits, bitmask, indices)
    return logits
