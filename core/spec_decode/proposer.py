"""The proposer interface and n-gram prompt lookup.

A proposer drafts up to ``k`` tokens per request after each step; the target model
verifies them all in the next step's forward (``verifier.py``).  EAGLE/MTP-style heads
fit the same protocol: they need the target's hidden states, which a later version can
hand to ``propose`` alongside the requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedserve.request import Request

__all__ = ["Draft", "Proposer", "NgramProposer"]


@dataclass
class Draft:
    """Tokens proposed for one request.  ``probs`` float32 ``[len(token_ids), vocab]``:
    the distribution each token was drawn from, or None when drafting is deterministic
    (then verification treats it as one-hot)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts tokens for running requests; keeps any per-request state until ``forget``."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        """Up to ``num_tokens[i]`` (>= 1) draft tokens following ``requests[i].all_token_ids``."""

    def forget(self, request_id: str) -> None:
        """Drop the request's state (it finished or was aborted)."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last ``n``
    tokens (n from ``max_n`` down to ``min_n``) and propose the tokens that followed it.
    Pays off when the output copies from the input (summaries, edits, code)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(r.all_token_ids, k)) for r, k in zip(requests, num_tokens)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix."""
        if len(tokens) < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a follower.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []

    def forget(self, request_id: str) -> None:
        pass
