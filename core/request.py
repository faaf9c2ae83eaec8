"""Request: one sequence being generated, as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A single sequence.  ``n > 1`` requests become several of these (one per sample).

    The only progress state is ``num_computed_tokens`` chasing ``num_tokens``: a
    prefill, a chunk of one, a continuation after a prefix hit and a decode are all
    "compute the tokens from num_computed_tokens up to num_tokens".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    max_model_len: int = 1 << 30
    #: A sibling whose prompt must be computed first so this one can reuse its blocks.
    wait_for: Request | None = None
    #: The sequence's grammar (pagedserve.structured_output.GrammarState) when constrained.
    structured: Any = None
    #: An embedding request's pooling type (pagedserve.pooling): no sampling, no decode.
    pooling: str | None = None
    #: The LoRA adapter (pagedserve.lora.LoRARequest) it runs with; None: the base model.
    lora_request: Any = None
    #: The prompt's images (pagedserve.multimodal.MultiModalItem), in prompt order.
    mm_items: list[Any] = field(default_factory=list)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (first schedule)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when a step first computed any of its tokens
    #: Draft tokens proposed for the next step (speculative decoding): scheduled after
    #: the known tokens and verified, never part of all_token_ids (nor prefix-cache hashes).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def mm_spans(self) -> tuple[tuple[int, int, str], ...]:
        """(offset, length, content hash) of each image's tokens in the prompt."""
        return tuple((m.offset, m.length, m.hash) for m in self.mm_items)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def ready(self) -> bool:
        """Whether the scheduler may admit this request now."""
        if self.structured is not None and not self.structured.ready():
            return False  # its grammar is still compiling
        w = self.wait_for
        if w is None:
            return True
        if w.is_finished or w.num_computed_tokens >= w.num_prompt_tokens - 1:
            self.wait_for = None
            return True
        return False

    def check_stop_by_token(self) -> RequestStatus | None:
        """Length, EOS and stop-token checks after a new token (stop strings are
        checked by the engine after detokenization)."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
