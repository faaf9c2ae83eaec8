"""Sampler: penalties, min_tokens, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Works on a batch of logits [num_seqs, vocab] (widened to float32 unless every row is
plain greedy).  Greedy rows take the argmax
of the (penalised) logits.  Random rows sample with the exponential-race trick
(argmax of probs / Exp(1) noise), drawing the noise from the request's own
``torch.Generator`` when it has a seed, so the same seed gives the same text whatever
else shares the batch.  Logprobs are those of the model's raw distribution.

One request's bad state fails that request only.  The sampler works on the whole batch,
but part of its work belongs to single requests: a seeded request's own generator, its
number of logprobs.  If that part raises (e.g. a seed torch cannot take), the whole step
would fail and with it every request in the batch.  So each row is first prepared on its
own; rows that fail are sampled as a placeholder (token 0) and their errors kept until
the engine takes them (``take_row_errors``) and fails those requests before the
placeholder is ever shown.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.executor.logits_processors import apply_logits_processors
from pagedserve.request import Request

__all__ = ["Sampler", "SamplerOutput"]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    #: Per row: (logprob of the sampled token, its rank, [(token id, logprob)] top-k) or None.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        #: request id -> why sampling failed for that request alone; the engine takes and
        #: clears these after every step (take_row_errors).
        self._row_errors: dict[str, str] = {}

    def take_row_errors(self) -> dict[str, str]:
        """The requests whose own sampling failed since the last call (request id -> why);
        their tokens are placeholders.  Clears them."""
        errors, self._row_errors = self._row_errors, {}
        return errors

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(seed)
            self._generators[request.request_id] = g
        return g

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """Whether every row only needs the argmax of its raw logits: greedy, no
        penalties, no logprobs, past min_tokens.  The model runner then takes the argmax
        where the logits are (the registry's ``argmax`` op) and skips this sampler."""
        return all(
            p.greedy
            and not p.needs_penalties
            and not p.needs_logits_processing
            and p.logprobs is None
            and r.num_output_tokens >= p.min_tokens
            for r, p in ((r, r.sampling_params) for r in requests)
        )

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits ``[num_seqs, vocab]`` in the model's dtype or float32, one row per request."""
        params = [r.sampling_params for r in requests]
        if self.plain_greedy(requests):
            # Plain greedy rows: the argmax needs no float32 copy (widening bf16 is exact,
            # so the chosen ids are the same) and no row gather.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        bad = self._failing_rows(requests, logits.shape[1])
        if bad:
            return self._sample_without(logits, requests, bad)
        logits = raw = logits.float()
        # vLLM's order: logit_bias and the other edits, min_tokens, then the penalties (a
        # seen token's repetition penalty scales its logit with the bias included).
        logits = apply_logits_processors(logits, requests)
        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_penalties(logits, requests)

        greedy = [p.greedy for p in params]
        tokens = torch.empty(len(requests), dtype=torch.int64)
        if any(greedy):
            g_idx = torch.tensor([i for i, g in enumerate(greedy) if g])
            tokens[g_idx] = logits[g_idx].argmax(dim=-1)
        if not all(greedy):
            r_idx = [i for i, g in enumerate(greedy) if not g]
            tokens[torch.tensor(r_idx)] = self._sample(logits[r_idx], [requests[i] for i in r_idx])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, requests, token_list))

    # -- rows that fail on their own ------------------------------------------------------
    def _failing_rows(self, requests: list[Request], vocab: int) -> dict[int, str]:
        """Row index -> error, for the rows whose own preparation raises."""
        bad: dict[int, str] = {}
        for i, request in enumerate(requests):
            try:
                self._generator(request)  # created and cached now: a seed torch refuses raises here
                logprobs = request.sampling_params.logprobs
                if logprobs is not None and logprobs > vocab:
                    raise ValueError(f"logprobs={logprobs} exceeds the vocabulary size {vocab}")
            except Exception as e:  # noqa: BLE001 - this request's own failure, reported by name
                bad[i] = f"{type(e).__name__}: {e}"
        return bad

    def _sample_without(self, logits: torch.Tensor, requests: list[Request], bad: dict[int, str]) -> SamplerOutput:
        """Sample the good rows as one batch; the bad rows get token 0 and a row error.
        logits ``[num_seqs, vocab]``."""
        for i, error in bad.items():
            self._row_errors[requests[i].request_id] = error
        tokens, logprobs = [0] * len(requests), [None] * len(requests)
        keep = [i for i in range(len(requests)) if i not in bad]
        if keep:
            sub = self(logits[keep], [requests[i] for i in keep])
            for j, i in enumerate(keep):
                tokens[i], logprobs[i] = sub.token_ids[j], sub.logprobs[j]
        return SamplerOutput(tokens, logprobs)

    # -- logit processors -------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            r, p = requests[i], requests[i].sampling_params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.int64)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64), minlength=vocab)[:vocab]
                row -= p.frequency_penalty * counts.float()
                row -= p.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned |= set(r.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                if not cloned:
                    logits, cloned = logits.clone(), True
                logits[i, banned] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self.probs(logits, requests)
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            noise[i].exponential_(generator=self._generator(r))
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution random rows sample from: float32 logits ``[n, vocab]`` (after
        penalties) -> probabilities ``[n, vocab]`` after temperature, top-k, top-p and
        min-p (unnormalised once top-p/min-p zero some out; speculative decoding verifies
        against these)."""
        params = [r.sampling_params for r in requests]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
        logits = logits / temps
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[1]
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        # min-p before top-p, as in vLLM: top-p measures its mass in what min-p leaves.
        # (min-p and top-k commute: both keep the largest logits.)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p
            probs = probs.masked_fill(probs < threshold, 0.0)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
        if bool((top_p < 1.0).any()):
            sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            # Keep the smallest set whose share of the mass left reaches top_p (always the
            # top token).
            remove_sorted = (cum - sorted_p) >= top_p * cum[:, -1:]
            remove = torch.zeros_like(remove_sorted).scatter(1, sorted_idx, remove_sorted)
            probs = probs.masked_fill(remove, 0.0)
        return probs

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, requests: list[Request], tokens: list[int]
    ) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        out: list = [None] * len(requests)
        if not rows:
            return out
        lp = torch.log_softmax(raw[rows], dim=-1)
        for j, i in enumerate(rows):
            k = requests[i].sampling_params.logprobs
            tok = tokens[i]
            tok_lp = lp[j, tok]
            rank = int((lp[j] > tok_lp).sum()) + 1
            top = []
            if k:
                vals, idx = lp[j].topk(k)
                top = list(zip(idx.tolist(), vals.tolist()))
            out[i] = (float(tok_lp), rank, top)
        return out
