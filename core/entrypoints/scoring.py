"""Relevance scores, shared by ``LLM.score`` and the server's /v1/score and /v1/rerank, by
one of two methods chosen by the checkpoint:

- a sequence-classification checkpoint (``LlamaForSequenceClassification`` and the like,
  pagedserve.pooling): the pair is the tokenizer's text-pair encoding of (query, document)
  (``tokenizer.json``'s pair template: its special tokens and separator, or the two texts'
  tokens one after the other when it has none), one classification request per pair, and
  the score is sigmoid(logit) of the one-label head (a cross-encoder's relevance); a head
  with several labels is refused (use classification);
- any other decoder is judged as a yes/no answerer (Qwen3-Reranker's method), below.

A (query, document) pair is written in Qwen3-Reranker's prompt format (a judging system
message, then ``<Instruct>``, ``<Query>`` and ``<Document>`` in the user turn, and an
empty think section in the assistant turn); the score is the probability of "yes" against
"no" as the next token: ``sigmoid(logprob(yes) - logprob(no))``, i.e. the softmax over the
two logits.  Each answer's log-probability is that of a one-token request allowed only
that token (the sampler reports logprobs of the raw logits), so two engine requests per
pair, which share their prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_INSTRUCTION",
    "ScoringOutput",
    "ScoringRequestOutput",
    "answer_logprob",
    "answer_params",
    "answer_token_ids",
    "pair_texts",
    "pair_token_ids",
    "check_score_labels",
    "relevance",
    "rerank_prompt",
]

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def answer_token_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of "yes" and "no"; ValueError unless each is one token of the vocabulary."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(
            "scoring needs 'yes' and 'no' to be single tokens of the model's vocabulary (a Qwen3-Reranker-style "
            "checkpoint); this tokenizer splits them"
        )
    return ids[0][0], ids[1][0]


def answer_params(token_id: int) -> SamplingParams:
    """One greedy token allowed only ``token_id``, with its log-probability."""
    return SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=[token_id], logprobs=0)


def answer_logprob(output: Any, token_id: int) -> float:
    """The log-probability of ``token_id`` in a finished answer_params request."""
    return output.outputs[0].logprobs[0][token_id].logprob


def relevance(logprob_yes: float, logprob_no: float) -> float:
    """P(yes) / (P(yes) + P(no))."""
    d = logprob_no - logprob_yes
    return 1.0 / (1.0 + math.exp(d)) if d < 700 else 0.0


def pair_texts(first: str | list[str], second: str | list[str], what: tuple[str, str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one with one, one with each of N, or N with N; ValueError naming the
    fields otherwise."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    if not a or not b:
        raise ValueError(f"'{what[0]}' and '{what[1]}' must not be empty")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise ValueError(f"'{what[0]}' must have one item or as many as '{what[1]}' ({len(a)} vs {len(b)})")
    return list(zip(a, b))


def pair_token_ids(tokenizer: Any, query: str, document: str) -> list[int]:
    """The text-pair encoding of (query, document) with the tokenizer's special tokens
    (transformers' ``tokenizer(query, document)``, which encodes the query alone when the
    document is empty)."""
    return tokenizer.backend.encode(query, document or None, add_special_tokens=True).ids


def check_score_labels(labels: list[str]) -> None:
    """ValueError unless a sequence-classification head has one label (a relevance)."""
    if len(labels) != 1:
        raise ValueError(
            f"scoring needs a sequence-classification head with one label (a relevance); this model has "
            f"{len(labels)} ({', '.join(labels)}): use classification instead"
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's shape: ``out.outputs.score``."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
