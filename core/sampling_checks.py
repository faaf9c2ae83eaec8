"""Checks of SamplingParams that every numeric and token-id field shares.

SamplingParams calls :func:`check_sampling_params` first, so its own range checks only
ever see real numbers: NaN passes most comparisons (``nan < 0`` is false) and would
otherwise reach the sampler, where ``temperature=nan`` turns every row into token 0.
Token ids are checked against [0, vocab) by the engine, which knows the vocabulary
(:func:`check_token_ids`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.sampling_params import SamplingParams

__all__ = ["check_sampling_params", "check_token_ids", "INT64_MIN", "INT64_MAX", "wrap_seed"]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Float fields and whether +/-infinity means something for them (none does today).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_MAX_LOGPROBS = 20


def _fail(name: str, limit: str, value: Any) -> None:
    raise ValueError(f"{name} must be {limit}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_floats(params: Any) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(name, "a number", value)
        if not math.isfinite(value):
            _fail(name, "a finite number", value)


def _check_id_list(name: str, value: Any, allow_empty: bool = True) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value):
        _fail(name, "a list of integer token ids", value)
    if not allow_empty and not value:
        _fail(name, "a non-empty list of token ids", value)
    for t in value:
        if t < 0:
            _fail(name, "a list of token ids >= 0", value)


def _check_logit_bias(params: SamplingParams) -> None:
    bias = params.logit_bias
    if bias is None:
        return
    if not isinstance(bias, dict):
        _fail("logit_bias", "a dict of token id -> bias", bias)
    fixed: dict[int, float] = {}
    for key, value in bias.items():
        # JSON object keys are strings: "50256" is token 50256, as in OpenAI's API.
        tid = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not _is_int(tid) or tid < 0:
            _fail("logit_bias", "keyed by token ids >= 0", key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail("logit_bias", "a dict of finite numbers", {key: value})
        fixed[tid] = max(-100.0, min(100.0, float(value)))
    params.logit_bias = fixed


def check_sampling_params(params: Any) -> None:
    """Types, finiteness and ranges shared by all fields; ValueError naming the field."""
    _check_floats(params)
    if params.seed is not None:
        if not _is_int(params.seed):
            _fail("seed", "an integer", params.seed)
        if not INT64_MIN <= params.seed <= INT64_MAX:
            _fail("seed", f"in the int64 range [{INT64_MIN}, {INT64_MAX}]", params.seed)
    _check_id_list("stop_token_ids", params.stop_token_ids)
    _check_id_list("allowed_token_ids", params.allowed_token_ids, allow_empty=False)
    _check_logit_bias(params)
    if params.bad_words is not None and (
        not isinstance(params.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in params.bad_words)
    ):
        _fail("bad_words", "a list of strings", params.bad_words)
    if params.prompt_logprobs is not None and (
        not _is_int(params.prompt_logprobs) or not -1 <= params.prompt_logprobs <= _MAX_LOGPROBS
    ):
        _fail(
            "prompt_logprobs", f"an integer in [0, {_MAX_LOGPROBS}], or -1 (full distributions)", params.prompt_logprobs
        )
    if params.truncate_prompt_tokens is not None and (
        not _is_int(params.truncate_prompt_tokens) or params.truncate_prompt_tokens < 1
    ):
        _fail("truncate_prompt_tokens", "an integer >= 1", params.truncate_prompt_tokens)
    if params.best_of is not None:
        if not _is_int(params.best_of) or not _is_int(params.n) or params.best_of < params.n:
            _fail("best_of", f"an integer >= n ({params.n})", params.best_of)


def check_token_ids(params: Any, vocab_size: int) -> None:
    """Every token-id field of ``params`` within [0, vocab_size); ValueError naming it."""
    fields = {
        "stop_token_ids": params.stop_token_ids or (),
        "allowed_token_ids": params.allowed_token_ids or (),
        "logit_bias": list(params.logit_bias or ()),
    }
    for name, ids in fields.items():
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name} contains token id {t}, outside the vocabulary [0, {vocab_size})")


def wrap_seed(seed: int) -> int:
    """``seed`` folded into the int64 range (sample i of n>1 uses seed + i)."""
    return (seed - INT64_MIN) % (1 << 64) + INT64_MIN
