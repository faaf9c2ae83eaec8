"""Outputs handed to users: RequestOutput and CompletionOutput (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompletionOutput", "RequestOutput", "Logprob"]


@dataclass
class Logprob:
    """Log-probability of one token; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    logprobs: when requested, one dict per generated token mapping token id to
    :class:`Logprob` (the sampled token plus the top-k).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    #: Set when this request failed on its own (finish_reason "error"); others go on.
    error: str | None = None
    #: With SamplingParams.prompt_logprobs: per prompt token, its entry (None for the first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    #: With SamplingParams.prompt_logprobs=-1, once finished: float32 torch tensor
    #: ``[num_prompt_tokens - 1, vocab]``, row i the log-distribution predicting prompt token i + 1.
    prompt_logprob_rows: Any = None
