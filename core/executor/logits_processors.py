"""Per-request logit edits: logit_bias, allowed_token_ids and bad_words (vLLM's names).

Each edit is vectorised over the rows that ask for it: the (row, token) pairs of every
row are gathered into one index tensor and written with a single ``index_put_``, so a
batch with many such requests costs one kernel per kind, not one per request.  All three
depend only on the request's own tokens, so they are unaffected by preemption, prefix
caching, chunked prefill or the other samples of an ``n > 1`` request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.request import Request

__all__ = ["apply_logits_processors", "bad_words_token_ids"]

_NEG_INF = float("-inf")


def bad_words_token_ids(words: Sequence[str], encode) -> list[list[int]]:
    """Token-id sequences to ban for ``words``: each word alone and after a space, as
    vLLM does (a word inside a sentence is usually tokenized with its leading space)."""
    out: list[list[int]] = []
    for word in words:
        for variant in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
            ids = encode(variant)
            if ids and ids not in out:
                out.append(ids)
    return out


def _banned_by_bad_words(request: Request) -> list[int]:
    """Tokens that would complete a bad word given the tokens generated so far."""
    seqs = getattr(request.sampling_params, "_bad_words_token_ids", None) or ()
    out = request.output_token_ids
    banned = []
    for seq in seqs:
        prefix = seq[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            banned.append(seq[-1])
    return banned


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits float32 ``[num_seqs, vocab]``, one row per request; returns the edited
    logits (a copy when any row is edited, else the same tensor)."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_logits_processing]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    bias_r, bias_c, bias_v, ban_r, ban_c = [], [], [], [], []
    allowed_rows: list[int] = []
    allowed_r: list[int] = []
    allowed_c: list[int] = []
    for i in rows:
        r, p = requests[i], requests[i].sampling_params
        if p.logit_bias:
            bias_r += [i] * len(p.logit_bias)
            bias_c += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if p.allowed_token_ids is not None:
            allowed_r += [len(allowed_rows)] * len(p.allowed_token_ids)
            allowed_c += p.allowed_token_ids
            allowed_rows.append(i)
        if p.bad_words:
            banned = _banned_by_bad_words(r)
            ban_r += [i] * len(banned)
            ban_c += banned
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool)
        keep[torch.tensor(allowed_r), torch.tensor(allowed_c)] = True
        idx = torch.tensor(allowed_rows)
        logits[idx] = logits[idx].masked_fill(~keep, _NEG_INF)
    if bias_r:
        logits.index_put_(
            (torch.tensor(bias_r), torch.tensor(bias_c)), torch.tensor(bias_v, dtype=logits.dtype), accumulate=True
        )
    if ban_r:
        logits[torch.tensor(ban_r), torch.tensor(ban_c)] = _NEG_INF
    return logits
