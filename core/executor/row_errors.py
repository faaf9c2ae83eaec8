"""Per-request failures inside the sampler: one request's bad state fails that request only.

The sampler works on the whole batch, but part of its work belongs to single requests:
a seeded request's own `torch.Generator`, its number of logprobs.
If that part raises (e.g. a seed torch cannot take), the whole step would fail and with
it every request in the batch.  So the sampler first prepares each row on its own
(`failing_rows`); rows that fail are sampled as a placeholder and named in
`Sampler.row_errors`, which the engine turns into that request's failure before the
placeholder token is ever shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.executor.sampler import Sampler, SamplerOutput
    from pagedserve.request import Request

__all__ = ["failing_rows", "sample_without"]


def _check_row(sampler: Sampler, request: Request, vocab: int) -> None:
    sampler._generator(request)  # created and cached now: a seed torch refuses raises here
    logprobs = request.sampling_params.logprobs
    if logprobs is not None and logprobs > vocab:
        raise ValueError(f"logprobs={logprobs} exceeds the vocabulary size {vocab}")


def failing_rows(sampler: Sampler, requests: list[Request], vocab: int) -> dict[int, str]:
    """Row index -> error, for the rows whose own preparation raises."""
    bad: dict[int, str] = {}
    for i, request in enumerate(requests):
        try:
            _check_row(sampler, request, vocab)
        except Exception as e:  # noqa: BLE001 - this request's own failure, reported by name
            bad[i] = f"{type(e).__name__}: {e}"
    return bad


def sample_without(
    sampler: Sampler, logits: torch.Tensor, requests: list[Request], bad: dict[int, str]
) -> SamplerOutput | None:
    """Sample the good rows as one batch; the bad rows get token 0 and an entry in
    `sampler.row_errors`.  logits ``[num_seqs, vocab]``.  With no good row this returns
    None (every token is a placeholder; the caller builds its own output)."""
    keep = [i for i in range(len(requests)) if i not in bad]
    for i, error in bad.items():
        sampler.row_errors[requests[i].request_id] = error
    if not keep:
        return None
    # The good rows' output, widened to every row (the sampler's own output type, so this
    # module needs no import of it).
    sub = sampler(logits[keep], [requests[i] for i in keep])
    tokens, logprobs = [0] * len(requests), [None] * len(requests)
    for j, i in enumerate(keep):
        tokens[i], logprobs[i] = sub.token_ids[j], sub.logprobs[j]
    return type(sub)(tokens, logprobs)
