"""The post-forward tail of a step: from the final hidden states to a StepOutput.

Every executor runs the same three parts, split where a step may cross processes:

1. :func:`plan_step`, where the step's inputs are built (the runner, or rank 0 of a
   distributed executor, before the forward): which final hidden rows the tail reads
   (:class:`TailRows`: the sampling rows, the prompt positions scored for
   ``prompt_logprobs``, the rows pooled for embeddings), the sampling requests, and the
   grammar bitmask of the constrained ones, filled by their matchers
   (pagedserve.structured_output.bitmask).  ``TailRows`` is plain data that travels with
   the inputs to the ranks that hold the final hidden states.
2. :func:`run_head`, wherever the final hidden states are (the runner, or every rank of
   the last pipeline stage: the vocab-parallel LM head all-gathers): logits of the
   sampling rows, prompt-logprob scores and pooled vectors (:class:`HeadOutput`, tensors
   only, so that a last stage elsewhere can send them to rank 0).
3. :func:`finish_step`, where the sampler is (the runner, or rank 0): the grammar mask,
   the greedy fast path (an argmax where the logits are) or the Sampler (penalties,
   logit_bias / allowed_token_ids / bad_words, min_tokens, temperature, top-k/p, seeds,
   logprobs), prompt logprobs and pooled parts filed by request.

So grammars, logits processors, prompt logprobs and pooling behave the same on one
process and under tensor or pipeline parallelism by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.executor.prompt_logprobs import (
    PromptRows,
    PromptScores,
    prompt_logprobs_by_request,
    prompt_rows,
    score_prompt_rows,
)
from pagedserve.executor.sampler import Sampler, SamplerOutput
from pagedserve.executor.step_rows import sample_index
from pagedserve.pooling import PooledPart, PoolSpan, pool_rows, pool_spans, pooled_parts
from pagedserve.request import Request
from pagedserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask, grammar_bitmask

__all__ = ["StepOutput", "TailRows", "HeadOutput", "StepPlan", "plan_step", "run_head", "finish_step"]


@dataclass
class StepOutput:
    """Sampled tokens by request id (only requests whose chunk reached the end)."""

    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]]
    #: Per request asking for them: (position, logprob, rank, top-k) of prompt tokens.
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    #: Embedding requests: this step's pooled final hidden states (pagedserve.pooling).
    pooled: dict[str, PooledPart] = field(default_factory=dict)
    #: Speculative decoding: per request that verified drafts, the drafts accepted (they
    #: come before its sampled token) and their logprob entries (when asked for).
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(default_factory=dict)

    def update(self, other: StepOutput) -> StepOutput:
        """Add another batch's results of the same step (micro-batches); returns self."""
        for name in ("sampled", "logprobs", "prompt_logprobs", "pooled", "accepted", "accepted_logprobs"):
            getattr(self, name).update(getattr(other, name))
        return self


@dataclass
class TailRows:
    """Which final hidden rows of a batch the tail reads: plain data.

    sample: int64 ``[num_sample]`` rows of the sampling requests' last tokens, or None
    when they are every row (a pure decode step: no gather); prompt: the rows scored for
    prompt logprobs; pool: the rows each embedding request pools.
    """

    sample: torch.Tensor | None
    num_sample: int
    prompt: PromptRows
    pool: list[PoolSpan]


@dataclass
class HeadOutput:
    """What the tail needs from the final hidden states of a batch.

    logits ``[num_sample, vocab]`` (the LM head's dtype; float32 when received from
    another stage), or None without sampling rows; prompt: None without scored rows;
    pooled float32 ``[len(pool), hidden_size]``.
    """

    logits: torch.Tensor | None
    prompt: PromptScores | None
    pooled: torch.Tensor

    @classmethod
    def empty(cls, rows: TailRows, vocab_size: int, hidden_size: int, device: torch.device) -> HeadOutput:
        """Buffers shaped as the head output of ``rows``, to receive it (float32 logits)."""
        logits = torch.empty(rows.num_sample, vocab_size, dtype=torch.float32, device=device)
        prompt = PromptScores.empty(rows.prompt, device) if rows.prompt.num_rows else None
        pooled = torch.empty(len(rows.pool), hidden_size, dtype=torch.float32, device=device)
        return cls(logits if rows.num_sample else None, prompt, pooled)

    def widened(self) -> HeadOutput:
        """This output with float32 logits (as :meth:`empty` lays them out)."""
        return HeadOutput(None if self.logits is None else self.logits.float(), self.prompt, self.pooled)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor with elements, in one fixed order (for sending and receiving)."""
        out = [] if self.logits is None else [self.logits]
        out += [] if self.prompt is None else self.prompt.tensors()
        return [t.contiguous() for t in [*out, self.pooled] if t.numel()]


_NO_PROMPT_ROWS = PromptRows()  # shared: never written


@dataclass
class StepPlan:
    """A batch's tail, decided before its forward: the rows to read, the sampling
    requests in row order, and the grammar bitmask of their constrained rows."""

    rows: TailRows
    requests: list[Request]
    grammar: GrammarBitmask | None


def plan_step(scheduled: list, logits_indices: torch.Tensor, vocab_size: int) -> StepPlan:
    """The tail of a batch: ``scheduled`` its ScheduledRequests in order, logits_indices
    int64 ``[len(scheduled)]`` (each one's last token row, as prepare_inputs gives),
    vocab_size the logits' width."""
    rows, scores, pools = [], False, False
    for i, s in enumerate(scheduled):  # one pass: most steps score and pool nothing
        r = s.request
        scores |= r.sampling_params.prompt_logprobs is not None
        if r.pooling is not None:
            pools = True
        elif s.samples:
            rows.append(i)
    requests = [scheduled[i].request for i in rows]
    tail = TailRows(
        sample_index(logits_indices, rows, scheduled),
        len(rows),
        prompt_rows(scheduled, vocab_size) if scores else _NO_PROMPT_ROWS,
        pool_spans(scheduled) if pools else [],
    )
    return StepPlan(tail, requests, grammar_bitmask(requests, vocab_size))


def run_head(
    model, hidden: torch.Tensor, rows: TailRows, to_device: Callable[[torch.Tensor], torch.Tensor]
) -> HeadOutput:
    """The head output of a batch from its final hidden states ``[num_tokens, hidden_size]``
    (after the final norm).  Under tensor parallelism every rank of the stage calls it
    with the same ``rows`` (``compute_logits`` all-gathers)."""
    logits = None
    if rows.num_sample:
        h = hidden if rows.sample is None else hidden.index_select(0, to_device(rows.sample))
        # The sampler widens to float32 only for rows that need more than an argmax.
        logits = model.compute_logits(h, float32=False).contiguous()
    prompt = None
    if rows.prompt.num_rows:
        prompt = score_prompt_rows(hidden, rows.prompt, model.compute_logits, to_device)
    return HeadOutput(logits, prompt, pool_rows(hidden, rows.pool))


def finish_step(sampler: Sampler, ops, plan: StepPlan, head: HeadOutput) -> StepOutput:
    """Mask, sample and file a batch's results.  ``ops``: the op registry of the logits'
    device (the registry's ``apply_token_bitmask`` and ``argmax`` run there)."""
    prompt_lps = prompt_logprobs_by_request(plan.rows.prompt, head.prompt) if head.prompt is not None else {}
    pooled = pooled_parts(plan.rows.pool, head.pooled) if plan.rows.pool else {}
    requests = plan.requests
    if not requests:
        return StepOutput({}, {}, prompt_lps, pooled)
    logits = head.logits
    if plan.grammar is not None:
        apply_grammar_bitmask(ops, logits, plan.grammar)
    if sampler.plain_greedy(requests):
        # Only the chosen ids leave the device.
        result = SamplerOutput(ops.argmax(logits).tolist(), [None] * len(requests))
    else:
        result = sampler(logits.cpu(), requests)
    sampled = {r.request_id: t for r, t in zip(requests, result.token_ids)}
    logprobs = {r.request_id: lp for r, lp in zip(requests, result.logprobs) if lp is not None}
    return StepOutput(sampled, logprobs, prompt_lps, pooled)
