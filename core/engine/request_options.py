"""Engine-side handling of per-request options: token-id checks against the vocabulary,
bad-word tokenization, the samples of ``n`` / ``best_of`` and prompt truncation."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.executor.logits_processors import bad_words_token_ids
from pagedserve.sampling_checks import check_token_ids, wrap_seed
from pagedserve.sampling_params import SamplingParams

__all__ = ["check_request_params", "sample_params", "best_sequences", "truncate_prompt", "continue_final_message"]


def check_request_params(params: SamplingParams, vocab_size: int, encode) -> None:
    """ValueError naming the field for what SamplingParams cannot check on its own."""
    check_token_ids(params, vocab_size)


def sample_params(params: SamplingParams, encode) -> list[SamplingParams]:
    """SamplingParams of each sample a request runs: ``best_of`` (or ``n``) of them.

    Sample i of a seeded request uses seed + i (folded into int64).  With best_of > n
    every sample computes its logprobs, since the n with the highest cumulative logprob
    are kept; only the first sample scores the prompt (prompt_logprobs).
    """
    count = params.best_of or params.n
    bad = bad_words_token_ids(params.bad_words, encode) if params.bad_words else None
    out = []
    for i in range(count):
        child = params
        if count > 1:
            seed = None if params.seed is None else wrap_seed(params.seed + i)
            logprobs = params.logprobs
            if count > params.n and logprobs is None:
                logprobs = 0
            child = replace(
                params,
                n=1,
                best_of=None,
                seed=seed,
                logprobs=logprobs,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            )
        child._bad_words_token_ids = bad
        out.append(child)
    return out


def best_sequences(seqs: list, n: int) -> list:
    """The ``n`` samples with the highest cumulative logprob, best first."""
    return sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


def truncate_prompt(ids: list[int], limit: int | None) -> list[int]:
    """The last ``limit`` prompt tokens (vLLM's truncate_prompt_tokens)."""
    return ids if limit is None or len(ids) <= limit else ids[-limit:]


def continue_final_message(text: str, messages: list[dict]) -> str:
    """A rendered conversation cut right after the final message's content, so the model
    continues that message (vLLM's and transformers' continue_final_message)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs an assistant message last")
    final = messages[-1].get("content") or ""
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a text final message")
    if not final:
        return text
    cut = text.rfind(final)
    if cut == -1:
        raise ValueError("continue_final_message: the chat template does not write the final message verbatim")
    return text[: cut + len(final)]
