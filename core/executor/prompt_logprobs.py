"""Log-probabilities of prompt tokens (``SamplingParams.prompt_logprobs``).

The logits at position ``p`` give the distribution of token ``p + 1``, so a prefill
chunk covering positions ``[c, c + n)`` yields the logprobs of prompt tokens
``c + 1 .. min(c + n, P - 1)`` (``P`` prompt tokens; the last prompt position predicts
the first generated token and belongs to the sampler).  Chunked prefill therefore needs
nothing special: each chunk scores its own positions.  The engine skips the prefix-cache
lookup for such a request (a cached block has no logits), and a recompute after
preemption scores the same positions again with the same result, so entries are stored
by position and overwriting is harmless.

Three parts, as the step's tail runs them (pagedserve.executor.sample_step):
:func:`prompt_rows` picks the rows from the scheduled requests, :func:`score_prompt_rows`
scores them where the final hidden states are (the last pipeline stage), and
:func:`prompt_logprobs_by_request` files the scores under their requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "PromptLogprobs",
    "PromptRows",
    "PromptScores",
    "prompt_rows",
    "score_prompt_rows",
    "prompt_logprobs_by_request",
]

#: Per request id: (position of the scored token, its logprob, its rank, top-k [(id, logprob)]),
#: plus the position's full log-distribution (float32 ``[vocab]``) for top-k -1.
PromptLogprobs = dict[str, list[tuple]]

_ROWS_PER_SLICE = 256  # bounds the float32 [rows, vocab] logits held at once


@dataclass
class PromptRows:
    """The token rows of a batch to score: plain data (it travels to the last stage).

    rows, targets: int64 ``[p]`` (a row of the batch, the prompt token its logits score);
    top: the largest top-k any of them asks for; spans: per request, (request id, first
    scored position, count, its own top-k, -1 for the full distribution), in row order.
    """

    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    targets: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    top: int = 0
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: The vocabulary width when some request asks for full distributions (top-k -1):
    #: every scored row's log-distribution is then kept; 0 otherwise.
    full: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.rows.numel())


@dataclass
class PromptScores:
    """Per scored row: its token's logprob (float32 ``[p]``) and rank (int64 ``[p]``), the
    top-``k`` logprobs (float32 ``[p, k]``) and ids (int64 ``[p, k]``), and with
    ``PromptRows.full`` the whole log-distribution (float32 ``[p, vocab]``; else ``[p, 0]``)."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    full: torch.Tensor

    @classmethod
    def empty(cls, rows: PromptRows, device: torch.device | str = "cpu") -> PromptScores:
        """Buffers of the shapes ``rows`` gives (to receive scores computed elsewhere)."""
        p, k = rows.num_rows, rows.top
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return cls(
            torch.empty(p, **f32),
            torch.empty(p, **i64),
            torch.empty(p, k, **f32),
            torch.empty(p, k, **i64),
            torch.empty(p, rows.full, **f32),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.logprobs, self.ranks, self.top_logprobs, self.top_ids, self.full]


def prompt_rows(scheduled, vocab_size: int = 0) -> PromptRows:
    """The rows of a batch (``scheduled``: its ScheduledRequests in order) to score;
    ``vocab_size`` is the width of a full distribution (asked for with top-k -1)."""
    flat, targets, spans = [], [], []
    start = 0
    for s in scheduled:
        r = s.request
        c, n = r.num_computed_tokens, s.num_new_tokens
        k = r.sampling_params.prompt_logprobs
        if k is not None:
            end = min(c + n, r.num_prompt_tokens - 1)
            if end > c:
                flat.extend(range(start, start + end - c))
                targets.extend(r.prompt_token_ids[c + 1 : end + 1])
                spans.append((r.request_id, c + 1, end - c, k))
        start += n
    if not flat:
        return PromptRows()
    top = max(k for *_, k in spans)
    full = vocab_size if any(k < 0 for *_, k in spans) else 0
    return PromptRows(
        torch.tensor(flat, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64), max(top, 0), spans, full
    )


def score_prompt_rows(
    hidden: torch.Tensor,
    rows: PromptRows,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> PromptScores:
    """Score ``rows`` of hidden ``[num_tokens, hidden_size]`` (the batch's final hidden
    states); compute_logits maps ``[n, hidden_size]`` to ``[n, vocab]`` (a collective
    under tensor parallelism: every rank of the stage calls it with the same rows).
    The scores stay on the logits' device."""
    parts: list[list[torch.Tensor]] = [[], [], [], [], []]
    for lo in range(0, rows.num_rows, _ROWS_PER_SLICE):
        idx = to_device(rows.rows[lo : lo + _ROWS_PER_SLICE])
        lp = torch.log_softmax(compute_logits(hidden.index_select(0, idx)).float(), dim=-1)
        chosen = lp.gather(1, rows.targets[lo : lo + _ROWS_PER_SLICE].to(lp.device).unsqueeze(1))
        parts[0].append(chosen.squeeze(1))
        parts[1].append((lp > chosen).sum(dim=1) + 1)
        v, i = lp.topk(rows.top, dim=-1)
        parts[2].append(v)
        parts[3].append(i)
        parts[4].append(lp if rows.full else lp[:, :0])
    return PromptScores(*(torch.cat(p) for p in parts))


def prompt_logprobs_by_request(rows: PromptRows, scores: PromptScores) -> PromptLogprobs:
    """The scores of ``rows`` filed by request id, each with its own top-k; a request
    asking for full distributions gets no top-k and, as a fifth element, its row's
    log-distribution (a float32 ``[vocab]`` view, on the CPU)."""
    if not rows.spans:
        return {}
    lps, rks = scores.logprobs.tolist(), scores.ranks.tolist()
    tv, ti = scores.top_logprobs.tolist(), scores.top_ids.tolist()
    full = scores.full.cpu() if rows.full else None
    result: PromptLogprobs = {}
    row = 0
    for rid, first, count, k in rows.spans:
        if k < 0:
            result[rid] = [(first + j, lps[row + j], int(rks[row + j]), [], full[row + j]) for j in range(count)]
        else:
            result[rid] = [
                (first + j, lps[row + j], int(rks[row + j]), list(zip(ti[row + j][:k], tv[row + j][:k])))
                for j in range(count)
            ]
        row += count
    return result
