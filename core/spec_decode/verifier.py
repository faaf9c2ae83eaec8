"""Verification of draft tokens against the target model's logits.

Row ``i`` with drafts ``d_1..d_k`` comes with ``k + 1`` rows of target logits: position
``j`` holds the target's next-token logits after ``d_1..d_j``.  Each position is
processed as the sampler would process that step (penalties and ``min_tokens`` see the
drafts before it as output tokens), then:

- greedy rows accept the longest prefix of drafts equal to the argmax, plus the argmax
  at the first mismatch (or the bonus token after the last draft): exactly the tokens
  greedy decoding would produce;
- random rows go through the registry's ``rejection_sample`` op (temperature, top-k,
  top-p and min-p shape the target distribution; the request's seeded generator draws
  the uniforms), which keeps the target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.executor.sampler import Sampler
from pagedserve.request import Request
from pagedserve.spec_decode.proposer import Draft

__all__ = ["Verified", "verify"]


@dataclass
class Verified:
    """One request's outcome: the accepted drafts followed by one sampled token, and
    the sampler's logprob entry for each of them (None when not asked for)."""

    tokens: list[int]
    logprobs: list | None

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class _Position:
    """A request as it would stand at one draft position: what the sampler's logit
    processors read (output so far, including the drafts before the position)."""

    __slots__ = ("request_id", "sampling_params", "eos_token_ids", "output_token_ids", "all_token_ids")

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.output_token_ids = request.output_token_ids + drafts if drafts else request.output_token_ids
        self.all_token_ids = request.all_token_ids + drafts if drafts else request.all_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]]


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[Draft], sampler: Sampler, ops) -> list[Verified]:
    """logits ``[sum(len(d.token_ids) + 1), vocab]`` (row blocks in request order, on the
    device, any float dtype) -> one Verified per request."""
    positions = [_Position(r, d.token_ids[:j]) for r, d in zip(requests, drafts) for j in range(len(d.token_ids) + 1)]
    offsets = [0]
    for d in drafts:
        offsets.append(offsets[-1] + len(d.token_ids) + 1)
    if Sampler.plain_greedy(positions):
        ids = ops.argmax(logits).tolist()
        return [
            Verified(_accept_greedy(d.token_ids, ids[offsets[i] : offsets[i + 1]]), None) for i, d in enumerate(drafts)
        ]
    raw = logits.float().cpu()
    proc = Sampler._apply_min_tokens(Sampler._apply_penalties(raw, positions), positions)
    tokens: list[list[int]] = [[] for _ in requests]
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
    if greedy:
        ids = proc.argmax(dim=-1).tolist()
        for i in greedy:
            tokens[i] = _accept_greedy(drafts[i].token_ids, ids[offsets[i] : offsets[i + 1]])
    randoms = [i for i, r in enumerate(requests) if not r.sampling_params.greedy and drafts[i].token_ids]
    undrafted = [i for i, r in enumerate(requests) if not r.sampling_params.greedy and not drafts[i].token_ids]
    if undrafted:
        # Exactly the sampler's own draw, so a seeded request's output does not depend
        # on whether others in its batch carry drafts.
        picked = sampler._sample(proc[[offsets[i] for i in undrafted]], [positions[offsets[i]] for i in undrafted])
        for i, t in zip(undrafted, picked.tolist()):
            tokens[i] = [t]
    if randoms:
        for i, row in zip(
            randoms, _rejection_sample(proc, positions, offsets, requests, drafts, randoms, sampler, ops)
        ):
            tokens[i] = row
    out = []
    for i, r in enumerate(requests):
        lps = None
        if r.sampling_params.logprobs is not None:
            rows = list(range(offsets[i], offsets[i] + len(tokens[i])))
            lps = Sampler._logprobs(raw[rows], [positions[j] for j in rows], tokens[i])
        out.append(Verified(tokens[i], lps))
    return out


def _rejection_sample(
    proc: torch.Tensor,
    positions: list[_Position],
    offsets: list[int],
    requests: list[Request],
    drafts: list[Draft],
    rows: list[int],
    sampler: Sampler,
    ops,
) -> list[list[int]]:
    """Tokens of the random ``rows`` through ``ops.rejection_sample``."""
    B, K, V = len(rows), max(len(drafts[i].token_ids) for i in rows), proc.shape[1]
    draft_ids = torch.zeros(B, K, dtype=torch.int64)
    num_draft = torch.zeros(B, dtype=torch.int64)
    target = torch.zeros(B, K + 1, V, dtype=torch.float32)
    with_probs = any(drafts[i].probs is not None for i in rows)
    draft_probs = torch.zeros(B, K, V, dtype=torch.float32) if with_probs else None
    uniform = torch.zeros(B, K, dtype=torch.float32)
    recover = torch.zeros(B, K + 1, dtype=torch.float32)
    for b, i in enumerate(rows):
        d = drafts[i]
        k = len(d.token_ids)
        num_draft[b] = k
        if k:
            draft_ids[b, :k] = torch.tensor(d.token_ids)
        span = range(offsets[i], offsets[i + 1])
        p = Sampler.probs(proc[span.start : span.stop], [positions[j] for j in span])
        target[b, : k + 1] = p / p.sum(dim=-1, keepdim=True)  # top-p/min-p leave it unnormalised
        if draft_probs is not None and k:
            draft_probs[b, :k] = (
                d.probs if d.probs is not None else torch.nn.functional.one_hot(draft_ids[b, :k], V).float()
            )
        # As many draws as the row's own drafts need, whatever the batch's widest row.
        g = sampler._generator(requests[i])
        uniform[b, :k] = torch.rand(k, generator=g)
        recover[b, : k + 1] = torch.rand(k + 1, generator=g)
    out = ops.rejection_sample(draft_ids, num_draft, draft_probs, target, uniform, recover)
    return [[t for t in row if t >= 0] for row in out.tolist()]
