"""Draft-model proposer: a smaller model (or the target's quantized copy) with its own
paged KV cache drafts ``k`` tokens autoregressively.

The draft keeps, per request, the tokens whose keys and values its cache holds.  Before
drafting it rolls that back to the longest prefix the request's verified tokens share
(the drafts the target rejected go) and computes the rest in one chunk, then runs ``k``
single-token steps over the whole batch.  Its blocks come from a pool of its own; a
request for which none is free simply gets no draft this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.sampler import Sampler
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.spec_decode.proposer import Draft

__all__ = ["DraftModelProposer"]


@dataclass(eq=False)
class _DraftSeq:
    """What the draft's KV manager and input preparation read of a request."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    is_finished: bool = False
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    """Drafts with ``runner`` (a ModelRunner whose KV cache is allocated, or a
    ``builder.DraftOnRanks`` for a draft sharded over the target's ranks: what is used
    is ``forward_logits``, ``ops``, ``num_blocks`` and ``block_size``) and a block pool
    of ``runner.num_blocks`` blocks."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self._seqs: dict[str, _DraftSeq] = {}
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
        self._generators.pop(request_id, None)

    def _sync(self, request: Request) -> _DraftSeq:
        """The request's draft state, rolled back to what its verified tokens share."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            seq = self._seqs[request.request_id] = _DraftSeq(request.request_id)
        tokens = request.all_token_ids
        m, cached = 0, seq.all_token_ids
        limit = min(seq.num_computed_tokens, len(tokens) - 1)  # the last token's logits are needed
        while m < limit and cached[m] == tokens[m]:
            m += 1
        seq.num_computed_tokens = m
        self.kv.trim(seq, m)
        seq.all_token_ids = list(tokens)
        return seq

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        seqs = [self._sync(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(num_tokens, default=0)):
            active = [i for i in active if num_tokens[i] > step]
            out = SchedulerOutput()
            for i in list(active):
                seq = seqs[i]
                n = seq.num_tokens - seq.num_computed_tokens
                if self.kv.allocate_slots(seq, n) is None:
                    active.remove(i)  # no block free: this request drafts no further
                    continue
                out.scheduled.append(ScheduledRequest(seq, n, True))
            if not active:
                break
            block_ids = {rid: self.kv.block_ids(rid) for rid in (seqs[i].request_id for i in active)}
            logits = self.runner.forward_logits(out, block_ids, [1] * len(active))
            tokens, q = self._draw(logits, [requests[i] for i in active])
            for row, i in enumerate(active):
                seq = seqs[i]
                seq.num_computed_tokens = seq.num_tokens
                seq.all_token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                if q is not None:
                    probs[i].append(q[row])
        out_drafts = []
        for i, seq in enumerate(seqs):
            # The cache holds keys and values up to the last draft's input.
            del seq.all_token_ids[seq.num_computed_tokens :]
            out_drafts.append(Draft(drafts[i], torch.stack(probs[i]) if probs[i] else None))
        return out_drafts

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], torch.Tensor | None]:
        """One draft token per row: the argmax for greedy requests; for random ones a
        sample of the draft's own distribution under the request's temperature, top-k,
        top-p and min-p, returned too (float32 ``[rows, vocab]``, normalised)."""
        if all(r.sampling_params.greedy for r in requests):
            return self.runner.ops.argmax(logits).tolist(), None
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        q = torch.zeros_like(logits)
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        p = Sampler.probs(logits[rows], [requests[i] for i in rows])
        p = p / p.sum(dim=-1, keepdim=True)
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(p[j], 1, generator=self._generator(requests[i])).item()
            q[i] = p[j]
        for i in set(range(len(requests))) - set(rows):
            q[i, tokens[i]] = 1.0
        return tokens.tolist(), q

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            # Its own stream, so drafting does not shift the target's seeded draws.
            g = self._generators[request.request_id] = torch.Generator().manual_seed(seed + 0x5EED)
        return g
