"""Reference of the speculative-decoding op ``rejection_sample`` (the specification).

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token ``d_j`` drawn
from the draft distribution ``q_j`` is accepted with probability ``min(1, p_j(d_j) /
q_j(d_j))`` where ``p_j`` is the target distribution at that position.  At the first
rejection the output is drawn from the residual ``norm(max(p_j - q_j, 0))``; when every
draft is accepted, a bonus token is drawn from the target's next distribution.  The
tokens so produced are distributed exactly as tokens sampled from the target one by one.

A proposer without a distribution (n-gram lookup) drafts deterministically: its ``q_j``
is one-hot on ``d_j`` (``draft_probs=None``), so ``d_j`` is accepted with probability
``p_j(d_j)`` and the residual is ``p_j`` without ``d_j``.

Randomness comes in as inputs so that implementations agree bit for bit: ``uniform``
decides acceptances and ``recover_uniform`` picks the residual or bonus token by
inverse CDF: the first token whose running sum (in float64, in vocabulary order)
exceeds ``recover_uniform * total``.
"""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """First index whose running sum exceeds ``u * sum``; the last positive index when
    rounding leaves none (u close to 1)."""
    cum = weights.double().cumsum(0)
    total = float(cum[-1])
    hit = torch.nonzero(cum > u * total)
    if hit.numel():
        return int(hit[0, 0])
    return int(torch.nonzero(weights > 0)[-1, 0])


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    recover_uniform: torch.Tensor,
) -> torch.Tensor:
    """Verify drafts against the target distribution; returns the tokens to emit.

    draft_token_ids int64 ``[B, K]`` (row i's first ``num_draft_tokens[i]`` are its
    drafts); num_draft_tokens int64 ``[B]``, each in [0, K]; draft_probs float32 ``[B, K,
    V]`` or None (one-hot drafts); target_probs float32 ``[B, K + 1, V]`` (row i's
    distributions at its draft positions, then at the position after them; each
    non-negative with a positive sum, rows past ``num_draft_tokens[i] + 1`` unread);
    uniform float32 ``[B, K]`` in [0, 1); recover_uniform float32 ``[B, K + 1]`` in [0, 1).

    Returns int64 ``[B, K + 1]``: row i's accepted drafts, then one residual or bonus
    token, then -1.
    """
    B, K = draft_token_ids.shape
    out = torch.full((B, K + 1), -1, dtype=torch.int64)
    for i in range(B):
        n = int(num_draft_tokens[i])
        for j in range(n + 1):
            p = target_probs[i, j]
            if j == n:  # every draft accepted: the bonus token
                out[i, j] = _inverse_cdf(p, float(recover_uniform[i, j]))
                break
            d = int(draft_token_ids[i, j])
            q_d = 1.0 if draft_probs is None else float(draft_probs[i, j, d])
            if float(uniform[i, j]) * q_d < float(p[d]):
                out[i, j] = d
                continue
            if draft_probs is None:
                residual = p.clone()
                residual[d] = 0.0
            else:
                residual = (p - draft_probs[i, j]).clamp_min(0.0)
            if not bool((residual > 0).any()):  # p == q up to rounding: any p-token is exact
                residual = p
            out[i, j] = _inverse_cdf(residual, float(recover_uniform[i, j]))
            break
    return out
