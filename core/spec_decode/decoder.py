"""SpecDecoder: proposes drafts after each step and verifies them in the next one.

The engine calls :meth:`SpecDecoder.propose` at the end of a step (drafts go to
``Request.spec_token_ids``, which the scheduler schedules like prompt tokens of the
request) and :meth:`SpecDecoder.execute` instead of the executor's ``execute`` when a
step carries drafts.  Every executor runs it the same way: ``Executor.forward_logits``
runs the step's forward on every rank (one process, tensor or pipeline parallel ranks)
and returns the verification rows' logits where the sampler is (rank 0, the engine's
process), and :func:`~pagedserve.spec_decode.verifier.verify` decides there, with the
engine's sampler.  Proposers run in the engine's process too: a draft model whole on
rank 0's device with its own KV cache, or, with ``draft_tensor_parallel_size``, driven
from there while its forwards run sharded on the target's ranks (builder.DraftOnRanks).
"""

from __future__ import annotations

import itertools

from pagedserve.executor.abstract import Executor
from pagedserve.executor.model_runner import StepOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.scheduler import SchedulerOutput
from pagedserve.spec_config import SpeculativeConfig
from pagedserve.spec_decode.proposer import Draft, Proposer
from pagedserve.spec_decode.verifier import verify

__all__ = ["SpecDecoder", "may_draft"]


def may_draft(request: Request) -> bool:
    """Whether ``request`` may share a step with drafts.

    Hook for structured outputs: a grammar-constrained request would need its matcher
    advanced over each draft and rolled back over the rejected ones (xgrammar's
    ``rollback``), and its rows masked during verification; until that is wired in, no
    step that samples for such a request carries drafts.  Pooling (embedding) requests
    sample nothing and take the executor's own path likewise, and so do requests whose
    sampling the verifier does not reproduce: prompt logprobs (every prompt position's
    logits) and per-request logit edits (logit_bias, allowed_token_ids, bad_words).
    """
    p = request.sampling_params
    return (
        p.structured_outputs is None
        and request.pooling is None
        and p.prompt_logprobs is None
        and not p.logit_bias
        and p.allowed_token_ids is None
        and not p.bad_words
    )


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, executor: Executor, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.executor = executor
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._draft_probs: dict[str, object] = {}
        # vLLM's counters: steps with drafts, draft tokens, accepted ones (and by position).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def _budget(self, request: Request) -> int:
        """Drafts that fit: accepting all of them plus the bonus token must stay within
        max_tokens and max_model_len."""
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return min(k, min(self.max_model_len, request.max_model_len) - request.num_tokens - 1)

    def hold_back(self, running: list[Request], waiting) -> None:
        """Before scheduling: drop every draft while a request that may not share a step
        with drafts (``may_draft``) is running or waiting, so that the step runs on the
        executor's own path (grammar masks, pooling)."""
        if any(r.spec_token_ids for r in running) and not all(map(may_draft, itertools.chain(running, waiting))):
            for r in running:
                r.spec_token_ids = []
                self._draft_probs.pop(r.request_id, None)

    def propose(self, running: list[Request]) -> None:
        """Draft for every running request that is decoding (its next step samples)."""
        if not all(map(may_draft, running)):
            return
        requests, budgets = [], []
        for r in running:
            if r.status != RequestStatus.RUNNING or r.spec_token_ids or r.num_computed_tokens != r.num_tokens - 1:
                continue
            k = self._budget(r)
            if k > 0:
                requests.append(r)
                budgets.append(k)
        if not requests:
            return
        for r, draft in zip(requests, self.proposer.propose(requests, budgets)):
            r.spec_token_ids = list(draft.token_ids)
            if draft.probs is not None:
                self._draft_probs[r.request_id] = draft.probs

    def forget(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self.proposer.forget(request_id)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput | None:
        """Forward and verify a step that carries drafts; None when none does (the
        executor then runs it as usual)."""
        if not any(s.spec_token_ids for s in out.scheduled):
            return None
        num_logits = [len(s.spec_token_ids) + 1 if s.samples else 0 for s in out.scheduled]
        logits = self.executor.forward_logits(out, block_ids, num_logits)
        rows = [s for s in out.scheduled if s.samples]
        drafts = []
        for s in rows:
            probs = self._draft_probs.pop(s.request.request_id, None)
            k = len(s.spec_token_ids)
            drafts.append(Draft(s.spec_token_ids, probs[:k] if probs is not None and k else None))
        # The engine's sampler (rank 0's); the ops of the device the logits are on.
        runner = self.executor.driver_runner
        results = verify(logits, [s.request for s in rows], drafts, runner.sampler, runner.model.head_ops)
        sampled, logprobs, accepted, accepted_lps = {}, {}, {}, {}
        for s, v in zip(rows, results):
            rid = s.request.request_id
            sampled[rid] = v.tokens[-1]
            if v.logprobs is not None:
                logprobs[rid] = v.logprobs[-1]
            if s.spec_token_ids:
                accepted[rid] = v.tokens[:-1]
                if v.logprobs is not None:
                    accepted_lps[rid] = v.logprobs[:-1]
                self._count(len(s.spec_token_ids), v.num_accepted)
        return StepOutput(sampled, logprobs, accepted=accepted, accepted_logprobs=accepted_lps)

    def _count(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def counters(self) -> dict[str, object]:
        """The counters, named as ``EngineStats`` fields."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.accepted_per_pos),
        }
