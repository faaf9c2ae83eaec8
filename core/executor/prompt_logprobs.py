"""Log-probabilities of prompt tokens (``SamplingParams.prompt_logprobs``).

The logits at position ``p`` give the distribution of token ``p + 1``, so a prefill
chunk covering positions ``[c, c + n)`` yields the logprobs of prompt tokens
``c + 1 .. min(c + n, P - 1)`` (``P`` prompt tokens; the last prompt position predicts
the first generated token and belongs to the sampler).  Chunked prefill therefore needs
nothing special: each chunk scores its own positions.  The engine skips the prefix-cache
lookup for such a request (a cached block has no logits), and a recompute after
preemption scores the same positions again with the same result, so entries are stored
by position and overwriting is harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.scheduler import SchedulerOutput

__all__ = ["PromptLogprobs", "compute_prompt_logprobs"]

#: Per request id: (position of the scored token, its logprob, its rank, top-k [(id, logprob)]).
PromptLogprobs = dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]]

_ROWS_PER_SLICE = 256  # bounds the float32 [rows, vocab] logits held at once


def _rows(out: SchedulerOutput) -> tuple[list[int], list[int], list[tuple[str, int, int]]]:
    """Flat token rows to score, their target ids, and (request id, first position, count)."""
    flat, targets, spans = [], [], []
    start = 0
    for s in out.scheduled:
        r = s.request
        c, n = r.num_computed_tokens, s.num_new_tokens
        if r.sampling_params.prompt_logprobs is not None:
            end = min(c + n, r.num_prompt_tokens - 1)
            if end > c:
                flat.extend(range(start, start + end - c))
                targets.extend(r.prompt_token_ids[c + 1 : end + 1])
                spans.append((r.request_id, c + 1, end - c))
        start += n
    return flat, targets, spans


def compute_prompt_logprobs(
    out: SchedulerOutput,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> PromptLogprobs:
    """Score the prompt tokens this step's chunks cover.

    hidden ``[num_tokens, hidden_size]``: the step's final hidden states in batch order;
    compute_logits maps ``[rows, hidden_size]`` to float32 ``[rows, vocab]``.
    """
    flat, targets, spans = _rows(out)
    if not flat:
        return {}
    tops = {r.request_id: r.sampling_params.prompt_logprobs for r in (s.request for s in out.scheduled)}
    k_max = max(tops[rid] for rid, _, _ in spans)
    tok_lp, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, len(flat), _ROWS_PER_SLICE):
        idx = to_device(torch.tensor(flat[lo : lo + _ROWS_PER_SLICE]))
        lp = torch.log_softmax(compute_logits(hidden.index_select(0, idx)).float(), dim=-1).cpu()
        tgt = torch.tensor(targets[lo : lo + _ROWS_PER_SLICE]).unsqueeze(1)
        chosen = lp.gather(1, tgt)
        tok_lp.append(chosen.squeeze(1))
        ranks.append((lp > chosen).sum(dim=1) + 1)
        if k_max:
            v, i = lp.topk(k_max, dim=-1)
            top_vals.append(v)
            top_ids.append(i)
    lps, rks = torch.cat(tok_lp).tolist(), torch.cat(ranks).tolist()
    tv = torch.cat(top_vals).tolist() if k_max else None
    ti = torch.cat(top_ids).tolist() if k_max else None
    result: PromptLogprobs = {}
    row = 0
    for rid, first, count in spans:
        k = tops[rid]
        entries = []
        for j in range(count):
            top = list(zip(ti[row + j][:k], tv[row + j][:k])) if k else []
            entries.append((first + j, lps[row + j], int(rks[row + j]), top))
        result[rid] = entries
        row += count
    return result
