"""Async scheduling: one step's output processing overlaps the next step's forward.

With ``async_scheduling`` the engine's step is split in two halves around the forward:

- right after step N's forward (serially, before anything else is scheduled): the
  scheduler update (tokens appended, computed counts advanced), the token-level stop
  checks (EOS, stop token ids, ``max_tokens``, ``max_model_len``) and the grammar's
  matcher, then releasing the requests they finished.  Step N+1 is scheduled from this
  state, so it is exactly the state the synchronous loop would schedule from, except
  for requests a *stop string* ends at step N (below).
- while step N+1's forward runs on the engine's thread, a helper thread detokenizes
  step N's tokens, checks stop strings, builds logprob entries and step N's
  ``RequestOutput`` objects.  A request a stop string ends there had already been
  scheduled in step N+1: its blocks are freed and its sampler state forgotten only
  after that forward returns, and the token it got there is dropped (the scheduler
  skips finished requests), so its outputs are those of the synchronous loop.

So ``step()`` returns the outputs of the step *before* the forward it ran; the last
call (nothing left to schedule) returns the final ones.  Between two calls nothing
runs in the background, so ``add_request`` and ``abort_request`` need no locking.

Outputs are the synchronous loop's, request by request (greedy tokens, logprobs, stop
strings, n > 1, streaming deltas, aborts); what can differ is the batch a request ran
in (a row finished by a stop string rides along for one more forward, and blocks it
frees reach waiting requests one step later), which changes no request's result with
batch-invariant kernels.  Speculative decoding and several ranks are refused in
``config_rules`` (drafting needs each step's accepted tokens before the next step).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.outputs import Logprob
from pagedserve.request import RequestStatus
from pagedserve.structured_output.engine_hooks import finish_by_grammar

if TYPE_CHECKING:
    from pagedserve.engine import LLMEngine, _Group, _Sequence
    from pagedserve.executor.model_runner import StepOutput
    from pagedserve.scheduler import SchedulerOutput

__all__ = ["StepPipeline"]

logger = logging.getLogger(__name__)


@dataclass
class _Token:
    """One sampled token whose text and stop strings are still to be processed."""

    group: _Group
    seq: _Sequence
    token: int
    logprob: Any  # (token logprob, rank, top entries) or None
    #: Set when a token-level stop already finished (and released) the sequence.
    status: RequestStatus | None


class StepPipeline:
    """The engine's step with output processing moved next to the following forward."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One helper thread: output processing of consecutive steps never overlaps itself.
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-outputs")
        self._tokens: list[_Token] = []
        #: Groups touched outside token processing (failed rows, finished embeddings).
        self._touched: dict[str, _Group] = {}
        #: Outputs built while a forward failed, returned by the next call.
        self._carry: list = []

    def shutdown(self) -> None:
        self._helper.shutdown(wait=True)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list:
        eng = self.engine
        start = time.monotonic()
        sched = eng.scheduler.schedule()
        if sched.empty:
            outputs, released = self._finish_previous()
            self._release(released)
            return self._take_carry() + outputs
        # Copies: a request a stop string finishes below gives its block list back.
        block_ids = {s.request.request_id: list(eng.kv.block_ids(s.request.request_id)) for s in sched.scheduled}
        previous = self._helper.submit(self._finish_previous)
        try:
            result = eng.executor.execute(sched, block_ids)
        except BaseException:
            outputs, released = previous.result()
            self._release(released)
            self._carry += outputs
            raise
        outputs, released = previous.result()
        self._release(released)
        self._after_forward(sched, result)
        eng.scheduler.last_step_latency = time.monotonic() - start
        return self._take_carry() + outputs

    def _take_carry(self) -> list:
        carry, self._carry = self._carry, []
        return carry

    def _release(self, released: list[tuple[_Sequence, RequestStatus]]) -> None:
        """Free what stop strings finished, now that no forward reads their state."""
        eng = self.engine
        for seq, status in released:
            if seq.request.request_id in eng._seq_of:
                eng._release(seq, status)

    # -- right after the forward ---------------------------------------------------------
    def _after_forward(self, sched: SchedulerOutput, result: StepOutput) -> None:
        """The synchronous loop's bookkeeping up to the stop checks that need no text."""
        eng = self.engine
        progressed = eng._account_step(sched, result)
        row_errors = eng.runner.take_row_errors()
        for request in progressed:
            entry = eng._seq_of.get(request.request_id)
            if entry is None:  # a sibling sample failed earlier in this loop
                continue
            group, seq = entry
            try:
                if request.request_id in row_errors:
                    raise RuntimeError(f"sampling failed: {row_errors[request.request_id]}")
                token = request.output_token_ids[-1]
                status = request.check_stop_by_token()
                if status is None and request.structured is not None:
                    status = finish_by_grammar(request, token)
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                eng._fail_group(group, e)
                self._touched[group.request_id] = group
                continue
            self._tokens.append(_Token(group, seq, token, result.logprobs.get(request.request_id), status))
            if status is not None:
                eng._release(seq, status)
        for rid, error in row_errors.items():  # a failed row that got no token this step
            if rid in eng._seq_of:
                group = eng._seq_of[rid][0]
                eng._fail_group(group, RuntimeError(f"sampling failed: {error}"))
                self._touched[group.request_id] = group
        self._touched.update(eng._finish_pooling(sched, result.pooled))

    # -- on the helper thread, beside the next forward ----------------------------------
    def _finish_previous(self) -> tuple[list, list[tuple[_Sequence, RequestStatus]]]:
        """Detokenize and stop-check the previous step's tokens; its outputs, and the
        sequences stop strings finished (to release once the forward is done)."""
        eng = self.engine
        tokens, self._tokens = self._tokens, []
        touched, self._touched = self._touched, {}
        released: list[tuple[_Sequence, RequestStatus]] = []
        for t in tokens:
            if eng.groups.get(t.group.request_id) is not t.group:
                continue  # aborted since
            try:
                self._process_text(t, released)
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                self._fail(t.group, e, released)
            touched[t.group.request_id] = t.group
        outputs = []
        for group in touched.values():
            if eng.groups.get(group.request_id) is not group:
                continue
            outputs.append(eng._make_output(group))
            if group.finished:
                eng.groups.pop(group.request_id, None)
        return outputs, released

    def _process_text(self, t: _Token, released: list[tuple[_Sequence, RequestStatus]]) -> None:
        """The synchronous loop's ``_process_token`` after its token-level checks."""
        eng, seq, group = self.engine, t.seq, t.group
        request = seq.request
        if seq.logprobs is not None and t.logprob is not None:
            tok_lp, rank, top = t.logprob
            entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(top)}
            entry[t.token] = Logprob(tok_lp, rank)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += tok_lp
        seq.text += seq.detok.step([t.token])
        status = t.status
        if status is None and seq.finish_reason is None:
            status = eng._check_stop_strings(seq)
            if status is not None:
                seq.finish_reason = status.value
                released.append((seq, status))
        if status is not None:
            if request.stop_reason is None or not isinstance(request.stop_reason, str):
                seq.text += seq.detok.flush()  # an incomplete character held back at the end
            group.metrics.setdefault("finished_time", time.monotonic())
        if request.first_token_time is not None:
            group.metrics.setdefault("first_token_time", request.first_token_time)

    def _fail(self, group: _Group, error: Exception, released: list[tuple[_Sequence, RequestStatus]]) -> None:
        """``_fail_group`` without touching the scheduler while a forward runs."""
        logger.error("request %s failed; the other requests go on", group.request_id, exc_info=error)
        group.error = f"{type(error).__name__}: {error}"
        for seq in group.seqs:
            if seq.finish_reason is None:
                released.append((seq, RequestStatus.FINISHED_ABORTED))
                seq.finish_reason = "error"
        group.metrics.setdefault("finished_time", time.monotonic())
