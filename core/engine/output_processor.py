"""Output processing: the engine-side state of each request, detokenization, stop
strings, logprobs and the ``RequestOutput`` objects a step returns.

The engine hands every step's result here (`OutputProcessor.process`); the async
pipeline (async_pipeline.py) uses the same pieces split around the next forward:
`check_token_stop` right after a forward, `append_text` / `check_stop_strings` /
`close_text` beside the next one, and `collect` to build the outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedserve.engine.request_options import best_sequences
from pagedserve.engine.stats import StepCounters
from pagedserve.loader import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.pooling import (
    ClassificationOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingState,
)
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.engine_hooks import check_grammar_failed, finish_by_grammar

__all__ = ["OutputProcessor", "OutputStage", "RequestState", "SequenceState", "logprob_entry"]

logger = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """Engine-side state of one sample: its Request plus detokenization and logprobs."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None


@dataclass
class RequestState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]
    arrival_time: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why this request failed on its own
    params: SamplingParams | None = None
    #: prompt_logprobs: entry of prompt token p (p >= 1) by position.
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    #: prompt_logprobs=-1: the log-distribution predicting prompt token p, by position.
    prompt_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    #: An embedding request: its pooled states so far and its options.
    pool: PoolingState | None = None
    pooling_params: PoolingParams | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def logprob_entry(token: int, lp: tuple[float, int, list]) -> dict[int, Logprob]:
    """One position's logprobs: the top entries (ranked 1, 2, ...) and the chosen token
    with its own rank; ``lp`` is (token logprob, rank, [(token id, logprob), ...])."""
    tok_lp, rank, top = lp
    entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(top)}
    entry[token] = Logprob(tok_lp, rank)
    return entry


class OutputStage(Protocol):
    """How a step's outputs are made: at once (`OutputProcessor`) or beside the next
    forward (`AsyncPipeline`)."""

    def overlap(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` (the step's forward), with whatever work goes beside it."""
        ...

    def process(self, sched, result, progressed: list[Request], row_errors: dict[str, str]) -> list:
        """The step's outputs after its forward and the scheduler's update."""
        ...

    def flush(self) -> list:
        """Outputs still held when a step schedules nothing."""
        ...

    def shutdown(self) -> None: ...


class OutputProcessor:
    """Request state from intake to the last output.

    ``release(request_id, status)`` frees what the rest of the engine holds for one
    sample (scheduler, sampler, drafter); ``counters`` counts the tokens generated."""

    def __init__(self, release: Callable[[str, RequestStatus], None], counters: StepCounters) -> None:
        self._release_sample = release
        self._counters = counters
        self.groups: dict[str, RequestState] = {}
        self._seq_of: dict[str, tuple[RequestState, SequenceState]] = {}

    # -- request state ------------------------------------------------------------------------
    def add(self, group: RequestState) -> None:
        for seq in group.seqs:
            self._seq_of[seq.request.request_id] = (group, seq)
        self.groups[group.request_id] = group

    def state_of(self, request_id: str) -> tuple[RequestState, SequenceState] | None:
        """The request and sample a scheduled request id belongs to (None once released)."""
        return self._seq_of.get(request_id)

    def is_live(self, group: RequestState) -> bool:
        """Whether ``group`` is still tracked (not aborted, its last output not returned)."""
        return self.groups.get(group.request_id) is group

    def release(self, seq: SequenceState, status: RequestStatus) -> None:
        rid = seq.request.request_id
        self._release_sample(rid, status)
        self._seq_of.pop(rid, None)
        if seq.finish_reason is None:
            seq.finish_reason = status.value

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            for seq in group.seqs if group is not None else ():
                self.release(seq, RequestStatus.FINISHED_ABORTED)

    def running_request_ids(self, running: set[str]) -> list[str]:
        return [gid for gid, g in self.groups.items() if any(s.request.request_id in running for s in g.seqs)]

    def fail_group(self, group: RequestState, error: Exception, release: Callable | None = None) -> None:
        """Finish every sample of `group` with finish_reason "error"; ``release(seq,
        status)`` frees each (default: at once)."""
        logger.error("request %s failed; the other requests go on", group.request_id, exc_info=error)
        group.error = f"{type(error).__name__}: {error}"
        for seq in group.seqs:
            if seq.finish_reason is None:
                (release or self.release)(seq, RequestStatus.FINISHED_ABORTED)
                seq.finish_reason = "error"
        group.metrics.setdefault("finished_time", time.monotonic())

    # -- after a forward ------------------------------------------------------------------------
    def account(self, progressed: list[Request], prompt_logprobs: dict[str, list]) -> None:
        """Prompt logprobs scored this step, and the times of the requests that gained a
        token (before their tokens are processed: a finished request is released)."""
        for rid, entries in prompt_logprobs.items():
            found = self._seq_of.get(rid)
            if found is None or found[0].prompt_logprobs is None:
                continue
            group = found[0]
            for pos, tok_lp, rank, top, *full in entries:
                group.prompt_logprobs[pos] = logprob_entry(group.prompt_token_ids[pos], (tok_lp, rank, top))
                if full:
                    group.prompt_rows[pos] = full[0]
        now = time.monotonic()
        for request in progressed:
            entry = self._seq_of.get(request.request_id)
            if entry is None:
                continue
            metrics = entry[0].metrics
            metrics["last_token_time"] = now
            if request.first_scheduled_time is not None:
                first = metrics.get("first_scheduled_time")
                if first is None or request.first_scheduled_time < first:
                    metrics["first_scheduled_time"] = request.first_scheduled_time

    def overlap(self, forward: Callable[[], Any]) -> Any:
        return forward()

    def flush(self) -> list:
        return []

    def shutdown(self) -> None:
        pass

    def process(self, sched, result, progressed: list[Request], row_errors: dict[str, str]) -> list:
        """Detokenize and stop-check each new token (with speculative decoding, the
        accepted drafts before it, in turn); a request whose own processing (or sampling:
        ``row_errors``) failed is failed alone.  The outputs of the requests touched."""
        accepted, accepted_lps = result.accepted or {}, result.accepted_logprobs or {}
        touched: dict[str, RequestState] = {}
        for request in progressed:
            entry = self._seq_of.get(request.request_id)
            if entry is None:  # a sibling sample failed earlier in this loop
                continue
            group, seq = entry
            rid = request.request_id
            try:
                if rid in row_errors:
                    raise RuntimeError(f"sampling failed: {row_errors[rid]}")
                n = len(accepted[rid]) + 1 if rid in accepted else 1
                lps = (accepted_lps.get(rid) or [None] * (n - 1)) + [result.logprobs.get(rid)]
                self._process_tokens(group, seq, lps)
            except Exception as e:  # noqa: BLE001 - this request's own failure; the batch goes on
                self.fail_group(group, e)
            touched[group.request_id] = group
        touched.update(self.fail_rows(row_errors))
        touched.update(self.finish_pooling(sched, result.pooled))
        return self.collect(touched.values())

    def fail_rows(self, row_errors: dict[str, str]) -> dict[str, RequestState]:
        """Fail the requests of rows whose sampling failed and that got no token."""
        touched = {}
        for rid, error in row_errors.items():
            if rid in self._seq_of:
                group = self._seq_of[rid][0]
                self.fail_group(group, RuntimeError(f"sampling failed: {error}"))
                touched[group.request_id] = group
        return touched

    def _process_tokens(self, group: RequestState, seq: SequenceState, lps: list) -> None:
        """The last ``len(lps)`` tokens of ``seq``, one at a time as if sampled in turn:
        tokens after one that stops the request are dropped.  The step counted one
        generated token for the request; the others (accepted drafts) are counted here."""
        request, n = seq.request, len(lps)
        tokens = request.output_token_ids[-n:]
        if n > 1:
            del request.output_token_ids[-n:], request.all_token_ids[-n:]
        for i, (token, lp) in enumerate(zip(tokens, lps)):
            if n > 1:
                request.append_token(token)
                self._counters.count_generated(1 if i else 0)
            self.append_text(seq, token, lp)
            status = self.check_token_stop(request, token)
            if status is None:
                status = self.check_stop_strings(seq)
            if status is not None:
                self.release(seq, status)
            self.close_text(group, seq, status)
            if seq.finish_reason is not None:
                break

    # -- the pieces of one token ----------------------------------------------------------------
    def check_token_stop(self, request: Request, token: int) -> RequestStatus | None:
        """The stop checks that need no text: EOS, stop token ids, lengths, the grammar."""
        check_grammar_failed(request)
        status = request.check_stop_by_token()
        if status is None and request.structured is not None:
            status = finish_by_grammar(request, token)
        return status

    def append_text(self, seq: SequenceState, token: int, lp) -> None:
        """``token``'s logprob entry (when asked for) and text."""
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(logprob_entry(token, lp))
            seq.cumulative_logprob += lp[0]
        seq.text += seq.detok.step([token])

    def check_stop_strings(self, seq: SequenceState) -> RequestStatus | None:
        request = seq.request
        params = request.sampling_params
        stops = params.stop_strings
        if not stops or request.num_output_tokens < params.min_tokens:
            return None
        # Only the tail that the new token can have completed needs searching.
        window = len(seq.text) - (max(map(len, stops)) + 16)
        best = None
        for s in stops:
            idx = seq.text.find(s, max(window, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        seq.text = seq.text[: idx + len(s)] if params.include_stop_str_in_output else seq.text[:idx]
        request.stop_reason = s
        return RequestStatus.FINISHED_STOPPED

    def close_text(self, group: RequestState, seq: SequenceState, status: RequestStatus | None) -> None:
        """After a token: a finished sample's held-back text and finish time; the first
        token's time."""
        request = seq.request
        if status is not None:
            if request.stop_reason is None or not isinstance(request.stop_reason, str):
                seq.text += seq.detok.flush()  # an incomplete character held back at the end
            group.metrics.setdefault("finished_time", time.monotonic())
        if request.first_token_time is not None:
            group.metrics.setdefault("first_token_time", request.first_token_time)

    # -- embeddings -----------------------------------------------------------------------------
    def finish_pooling(self, sched, pooled: dict) -> dict[str, RequestState]:
        """Fold this step's pooled states in; finish (and free) requests whose prompt is done."""
        done: dict[str, RequestState] = {}
        for s in sched.scheduled:
            r = s.request
            entry = self._seq_of.get(r.request_id) if r.pooling is not None else None
            if entry is None:
                continue
            group, seq = entry
            if r.request_id in pooled:
                group.pool.add(pooled[r.request_id])
            if r.num_computed_tokens >= r.num_prompt_tokens:
                self.release(seq, RequestStatus.FINISHED_STOPPED)
                group.metrics.setdefault("finished_time", time.monotonic())
                done[group.request_id] = group
        return done

    # -- outputs --------------------------------------------------------------------------------
    def collect(self, touched: Iterable[RequestState]) -> list:
        """The outputs of the live requests among ``touched``; finished ones are dropped."""
        outputs = []
        for group in touched:
            if not self.is_live(group):
                continue
            outputs.append(self.make_output(group))
            if group.finished:
                self.groups.pop(group.request_id, None)
        return outputs

    def make_output(self, group: RequestState) -> RequestOutput | EmbeddingRequestOutput:
        if group.pool is not None:
            return _embedding_output(group)
        seqs, params = group.seqs, group.params
        if params is not None and len(seqs) > params.n:
            # best_of: the n best samples once all are done; nothing before.
            seqs = best_sequences(seqs, params.n) if group.finished else []
        want_logprobs = params is None or params.logprobs is not None
        outs = [
            CompletionOutput(
                index=index,
                text=_visible_text(seq),
                token_ids=list(seq.request.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.request.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None and want_logprobs else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            )
            for index, seq in enumerate(seqs)
        ]
        metrics = {**group.metrics, "arrival_time": group.arrival_time}
        cached = group.seqs[0].request.num_cached_tokens
        out = RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, outs, group.finished, cached, metrics, group.error
        )
        if group.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [group.prompt_logprobs.get(p) for p in range(1, len(group.prompt_token_ids))]
            if group.prompt_rows and group.finished:
                out.prompt_logprob_rows = _stack_rows(group.prompt_rows, len(group.prompt_token_ids))
        return out


def _stack_rows(rows: dict[int, torch.Tensor], num_prompt: int) -> torch.Tensor:
    """float32 ``[num_prompt - 1, vocab]``: row i the log-distribution predicting prompt
    token i + 1 (every position is scored before the request finishes)."""
    return torch.stack([rows[p] for p in range(1, num_prompt)])


def _visible_text(seq: SequenceState) -> str:
    """While running, hold back a tail that could still become a stop string."""
    stops = seq.request.sampling_params.stop_strings
    if seq.finish_reason is not None or not stops:
        return seq.text
    hold = max(map(len, stops)) - 1
    return seq.text[: len(seq.text) - hold] if hold > 0 else seq.text


def _embedding_output(group: RequestState) -> EmbeddingRequestOutput:
    out = EmbeddingRequestOutput(
        group.request_id,
        None,
        group.prompt_token_ids,
        group.prompt,
        group.finished,
        group.error,
        {**group.metrics, "arrival_time": group.arrival_time},
    )
    if group.error is None and group.seqs[0].finish_reason == "stop":  # its whole prompt was pooled
        try:
            vector = group.pool.result(group.pooling_params.normalize)
            kind = ClassificationOutput if group.pool.head is not None else EmbeddingOutput
            out.outputs = kind(vector)
        except RuntimeError as e:
            out.error = f"{type(e).__name__}: {e}"
    return out
