"""Async scheduling: one step's output processing overlaps the next step's forward.

With ``async_scheduling`` the engine's output stage (`OutputStage`) is this pipeline, which
splits a step's output processing in two halves around the forward:

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

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import StepOutput
    from pagedserve.scheduler import SchedulerOutput

__all__ = ["AsyncPipeline"]


@dataclass
class _Token:
    """One sampled token whose text and stop strings are still to be processed."""

    group: RequestState
    seq: SequenceState
    token: int
    logprob: Any  # (token logprob, rank, top entries) or None
    #: Set when a token-level stop already finished (and released) the sequence.
    status: RequestStatus | None


class AsyncPipeline:
    """The output stage with text processing moved next to the following forward."""

    def __init__(self, output: OutputProcessor) -> None:
        self.output = output
        # One helper thread: output processing of consecutive steps never overlaps itself.
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-outputs")
        self._tokens: list[_Token] = []
        #: Groups touched outside token processing (failed rows, finished embeddings).
        self._touched: dict[str, RequestState] = {}
        #: Outputs of the previous step, finished beside this step's forward.
        self._ready: list = []
        #: Outputs built while a forward failed, returned by the next call.
        self._carry: list = []

    def shutdown(self) -> None:
        self._helper.shutdown(wait=True)

    # -- the stage --------------------------------------------------------------------------
    def overlap(self, forward: Callable[[], Any]) -> Any:
        """The previous step's text processing on the helper thread beside ``forward``."""
        previous = self._helper.submit(self._finish_previous)
        try:
            result = forward()
        except BaseException:
            outputs, released = previous.result()
            self._release(released)
            self._carry += outputs
            raise
        outputs, released = previous.result()
        self._release(released)
        self._ready = outputs
        return result

    def process(
        self, sched: SchedulerOutput, result: StepOutput, progressed: list[Request], row_errors: dict[str, str]
    ) -> list:
        """This step's token-level stop checks (text waits for the next forward); the
        previous step's outputs."""
        self._after_forward(sched, result, progressed, row_errors)
        ready, self._ready = self._ready, []
        return self._take_carry() + ready

    def flush(self) -> list:
        outputs, released = self._finish_previous()
        self._release(released)
        return self._take_carry() + outputs

    def _take_carry(self) -> list:
        carry, self._carry = self._carry, []
        return carry

    def _release(self, released: list[tuple[SequenceState, RequestStatus]]) -> None:
        """Free what stop strings finished, now that no forward reads their state."""
        for seq, status in released:
            if self.output.state_of(seq.request.request_id) is not None:
                self.output.release(seq, status)

    # -- right after the forward ---------------------------------------------------------
    def _after_forward(
        self, sched: SchedulerOutput, result: StepOutput, progressed: list[Request], row_errors: dict[str, str]
    ) -> None:
        """The synchronous loop's bookkeeping up to the stop checks that need no text."""
        out = self.output
        for request in progressed:
            entry = out.state_of(request.request_id)
            if entry is None:  # a sibling sample failed earlier in this loop
                continue
            group, seq = entry
            try:
                if request.request_id in row_errors:
                    raise RuntimeError(f"sampling failed: {row_errors[request.request_id]}")
                token = request.output_token_ids[-1]
                status = out.check_token_stop(request, token)
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                out.fail_group(group, e)
                self._touched[group.request_id] = group
                continue
            self._tokens.append(_Token(group, seq, token, result.logprobs.get(request.request_id), status))
            if status is not None:
                out.release(seq, status)
        self._touched.update(out.fail_rows(row_errors))
        self._touched.update(out.finish_pooling(sched, result.pooled))

    # -- on the helper thread, beside the next forward ----------------------------------
    def _finish_previous(self) -> tuple[list, list[tuple[SequenceState, RequestStatus]]]:
        """Detokenize and stop-check the previous step's tokens; its outputs, and the
        sequences stop strings finished (to release once the forward is done)."""
        out = self.output
        tokens, self._tokens = self._tokens, []
        touched, self._touched = self._touched, {}
        released: list[tuple[SequenceState, RequestStatus]] = []
        for t in tokens:
            if not out.is_live(t.group):
                continue  # aborted since
            try:
                self._process_text(t, released)
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                # Without touching the scheduler while a forward runs: released afterwards.
                out.fail_group(t.group, e, release=lambda seq, status: released.append((seq, status)))
            touched[t.group.request_id] = t.group
        return out.collect(touched.values()), released

    def _process_text(self, t: _Token, released: list[tuple[SequenceState, RequestStatus]]) -> None:
        """The synchronous loop's token processing after its token-level checks."""
        out, seq = self.output, t.seq
        out.append_text(seq, t.token, t.logprob)
        status = t.status
        if status is None and seq.finish_reason is None:
            status = out.check_stop_strings(seq)
            if status is not None:
                seq.finish_reason = status.value
                released.append((seq, status))
        out.close_text(t.group, seq, status)
