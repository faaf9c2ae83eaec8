"""Continuous-batching scheduler over one token budget per step.

There are no prefill and decode phases: each request has ``num_computed_tokens``
chasing ``num_tokens`` and the scheduler hands out a budget of tokens per step,
running requests first (decodes and unfinished prefill chunks), then waiting ones.
Chunked prefill, prefix-cache continuations and decodes all fall out of that rule.
When blocks run out, the lowest-priority running request (the latest arrival under
FCFS) is preempted: by recompute (its blocks are freed and it goes back to the front
of the waiting queue), or, with a host KV tier and when a cost model says copying is
cheaper, by swap (its KV is copied to host and copied back when it resumes).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.host_tier import KVTransfers
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    #: Whether this chunk reaches the end of the known tokens (so a token is sampled).
    samples: bool
    #: Draft tokens scheduled after the known ones, to verify (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    #: Recurrent-state checkpoint work of this chunk (kv_cache.state_group.StateStep), or None.
    state: Any = None


@dataclass
class SchedulerOutput:
    """Everything the executor needs for one step; a plain dataclass."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    #: KV block copies between device and host tiers, run before this step's forward.
    kv_transfers: KVTransfers | None = None

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        default_long_prefill: int = 0,
        max_loras: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        encoder_budget: int = 0,
        whole_image_spans: bool = False,
    ) -> None:
        self.config = config
        #: Whether a chunk may end inside an image's tokens: not when they attend to each
        #: other both ways (Gemma 3), so all of them must be computed in one step.
        self.whole_image_spans = whole_image_spans
        #: Image tokens whose vision-encoder output one step may compute, and that the
        #: encoder cache may hold for prompts still being prefilled (0: no images).  A
        #: chunk that would start encoding more is cut before the image that does not
        #: fit; an image larger than the whole budget is encoded alone.
        self.encoder_budget = encoder_budget
        self._encoder_left = 0
        self._encoder_cache_left = 0
        #: Per running request: the images (content hashes) a chunk of it has already
        #: encoded since it was last admitted (their outputs are in the encoder cache).
        self._encoded: dict[str, set[str]] = {}
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.last_step_latency = 0.0
        #: The clock arrival and first-token times are read on (the capacity planner
        #: substitutes a simulated one).
        self.clock = clock
        #: Most distinct LoRA adapters among running requests (with enable_lora; None: no
        #: limit): a waiting request with another adapter waits until one of them finishes.
        self.max_loras = max_loras
        #: Most prompt tokens one request gets per step (0: no cap): the setting, else
        #: ``default_long_prefill`` (the platform's) when prompts may be chunked.
        threshold = config.long_prefill_token_threshold
        if threshold is None:
            threshold = default_long_prefill if config.enable_chunked_prefill else 0
        self.long_prefill_token_threshold = threshold
        #: Most prompt tokens of a step, all requests together, while some request decodes
        #: (0: no cap): the setting, else the platform's long-prefill default as above.
        with_decodes = config.max_prefill_tokens_with_decodes
        if with_decodes is None:
            with_decodes = default_long_prefill if config.enable_chunked_prefill else 0
        self.max_prefill_tokens_with_decodes = with_decodes
        #: Prompt tokens the step being scheduled may still take (None: no cap this step).
        self._prefill_left: int | None = None

    def record_step_latency(self, seconds: float) -> None:
        """How long the last step took (scheduler_delay_factor waits a multiple of it)."""
        self.last_step_latency = seconds

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not self.kv.can_fit(min(request.num_tokens + 1, self.max_model_len), self.config.max_num_batched_tokens):
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs more KV blocks than the whole "
                f"cache has ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)"
            )
        self.requests[request.request_id] = request
        if self.config.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def _insert_by_priority(self, request: Request) -> None:
        """Keep waiting sorted by (priority, arrival); lower value = served first."""
        idx = len(self.waiting)
        key = (request.priority, request.arrival_time)
        for i, r in enumerate(self.waiting):
            if (r.priority, r.arrival_time) > key:
                idx = i
                break
        self.waiting.insert(idx, request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request at any moment and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self._encoded.pop(request_id, None)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- scheduling ---------------------------------------------------------------------
    def _victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if self.kv.should_swap(request):
            # Its KV goes to the host tier; num_computed_tokens stays and it resumes
            # by swapping back in.
            self.kv.swap_out(request)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed again once it runs
        self._encoded.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        n = request.num_tokens_with_spec - request.num_computed_tokens
        if request.spec_token_ids and n > budget:
            # Drafts that do not fit this step's budget are dropped, never split off.
            del request.spec_token_ids[max(budget - (request.num_tokens - request.num_computed_tokens), 0) :]
            n = request.num_tokens_with_spec - request.num_computed_tokens
        cap = self.long_prefill_token_threshold
        if 0 < cap < n and not request.spec_token_ids:
            n = cap  # a long prompt goes in chunks, so decodes sharing the step are not held up
        if self._prefill_left is not None and _is_prefill(request):
            n = min(n, self._prefill_left)  # this step's decodes wait for every prompt chunk in it
        # Without chunked prefill a request waits for a step with room for all its tokens.
        # Admission keeps prompts within one step; only a request preempted by recompute
        # after outgrowing the budget can exceed it, and it is chunked rather than starved.
        if not self.config.enable_chunked_prefill and budget < n <= self.config.max_num_batched_tokens:
            return 0
        n = min(n, budget)
        if request.mm_items and self.whole_image_spans:
            n = self._whole_spans(request, n, budget)
        return self._encoder_fit(request, n) if request.mm_items and self.encoder_budget else n

    def _whole_spans(self, request: Request, n: int, budget: int) -> int:
        """``n`` moved so the chunk does not end inside an image's tokens: cut before an
        image it would split, or, when the chunk starts at or inside one (a prefix-cache
        hit may end inside an image: those cached tokens were computed with the whole
        image), taken to the image's end when the step's budget holds it, past the
        per-request and with-decodes prompt caps (else 0: the request waits)."""
        start = request.num_computed_tokens
        if n == 0:
            return 0
        for item in request.mm_items:
            if item.offset < start + n < item.end:
                if item.offset > start:
                    return item.offset - start
                return item.end - start if item.end - start <= budget else 0
        return n

    def _new_images(self, request: Request, n: int) -> list:
        """The images whose tokens the next ``n`` tokens of ``request`` touch and whose
        encoder output this request has not computed since it was admitted."""
        start, done = request.num_computed_tokens, self._encoded.get(request.request_id, ())
        return [m for m in request.mm_items if m.offset < start + n and m.end > start and m.hash not in done]

    def _encoder_fit(self, request: Request, n: int) -> int:
        """``n`` cut before the first image that this step's encoder budget, or the
        encoder cache's room, cannot take."""
        left, room, budget = self._encoder_left, self._encoder_cache_left, self.encoder_budget
        for item in self._new_images(request, n):
            alone = left == budget and room == budget and item.length > budget
            if (item.length > left or item.length > room) and not alone:
                return max(item.offset - request.num_computed_tokens, 0)
            left -= item.length
            room -= item.length
        return n

    def _held_image_tokens(self) -> int:
        """Image tokens whose encoder outputs running requests still hold: images they
        started encoding and have not prefilled to the end."""
        total = 0
        for r in self.running:
            done = self._encoded.get(r.request_id)
            if done:
                total += sum(m.length for m in r.mm_items if m.hash in done and m.end > r.num_computed_tokens)
        return total

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
        if not out.empty:
            # Copies decided while scheduling (spills, reloads, swaps) run before this
            # step's forward; after an empty step the engine runs them (flush_transfers).
            out.kv_transfers = self.kv.take_transfers()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        with_decodes = self.max_prefill_tokens_with_decodes
        decoding = with_decodes > 0 and any(not _is_prefill(r) for r in self.running)
        self._prefill_left = with_decodes if decoding else None
        self._encoder_left = self.encoder_budget
        if self.encoder_budget:
            self._encoder_cache_left = self.encoder_budget - self._held_image_tokens()

        # 1. Running requests, oldest first; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n == 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, n) is None:
                if request.spec_token_ids:
                    # Drafts are optional: drop them before preempting anyone.
                    request.spec_token_ids = []
                    n = self._num_new_tokens(request, budget)
                    continue
                # Only requests not yet scheduled in this step can give blocks back.
                victim = self._victim(self.running[i:])
                self._preempt(victim, out)
                if victim is request:
                    n = 0
                    break
            if n == 0:
                continue  # request itself was preempted; running[i] is now the next one
            self._add(out, request, n)
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step had to preempt (no room anyway).
        if out.preempted or not self._passed_delay():
            return out
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not request.ready() or not self._lora_fits(request):
                skipped.append(self.waiting.popleft())
                continue
            # Non-zero only for a request swapped out by preemption: it swaps back in.
            resumed = request.num_computed_tokens
            computed, num_computed = [], resumed
            # prompt_logprobs needs the logits of every prompt position: no cache hit.
            # So does mean/cls pooling (embeddings): it pools every prompt position.
            if (
                resumed == 0
                and request.sampling_params.prompt_logprobs is None
                and request.pooling not in ("mean", "cls")
            ):
                computed, num_computed = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_computed
            n = self._num_new_tokens(request, budget)
            if n == 0 or self.kv.allocate_slots(request, n, computed) is None:
                request.num_computed_tokens = resumed
                break
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add(out, request, n)
            budget -= n
        for request in reversed(skipped):
            self.waiting.appendleft(request)
        return out

    def _lora_fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter is running already or one more fits max_loras."""
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in active or len(active) < self.max_loras

    def _passed_delay(self) -> bool:
        """vLLM's scheduler_delay_factor: hold new prefills briefly so arrivals batch."""
        if self.config.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        earliest = min(r.arrival_time for r in self.waiting)
        return self.clock() - earliest > self.config.delay_factor * self.last_step_latency

    def _add(self, out: SchedulerOutput, request: Request, n: int) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        samples = request.num_computed_tokens + n >= request.num_tokens
        if self._prefill_left is not None and _is_prefill(request):
            self._prefill_left = max(0, self._prefill_left - n)  # a whole image may pass it
        if request.mm_items and self.encoder_budget:
            for item in self._new_images(request, n):
                self._encoder_left -= item.length
                self._encoder_cache_left -= item.length
                self._encoded.setdefault(request.request_id, set()).add(item.hash)
        state_step = getattr(self.kv, "state_step", None)
        state = state_step(request) if state_step is not None else None
        out.scheduled.append(ScheduledRequest(request, n, samples, list(request.spec_token_ids), state))
        out.num_batched_tokens += n

    def update_after_step(
        self, out: SchedulerOutput, sampled: dict[str, int], accepted: dict[str, list[int]] | None = None
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens; returns requests that sampled.

        ``accepted``: per request that verified drafts, the drafts accepted (appended
        before its sampled token); the slots of rejected drafts are given back.
        """
        progressed = []
        now = self.clock()
        for s in out.scheduled:
            request = s.request
            if request.is_finished:
                continue
            request.num_computed_tokens += s.num_new_tokens
            if s.spec_token_ids:
                acc = accepted.get(request.request_id, []) if accepted else []
                request.num_computed_tokens -= len(s.spec_token_ids) - len(acc)
                request.spec_token_ids = []
                for token in acc:
                    request.append_token(token)
                # After the accepted tokens are known: a recurrent state's trim hashes them.
                self.kv.trim(request, request.num_computed_tokens)
            if s.samples and request.pooling is None:  # a pooling request samples nothing
                request.append_token(sampled[request.request_id])
                if request.first_token_time is None:
                    request.first_token_time = now
                progressed.append(request)
        return progressed


def _is_prefill(request: Request) -> bool:
    """Whether ``request`` computes prompt tokens (or recomputes outputs after a preemption)
    rather than decoding the one token it sampled last."""
    return (
        request.num_computed_tokens < request.num_prompt_tokens or request.num_tokens - request.num_computed_tokens > 1
    )
