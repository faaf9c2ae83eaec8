"""max_prefill_tokens_with_decodes: while any request decodes, a step's prompt tokens of
all requests together stay under one budget, so the step (every decode's inter-token gap)
stays short; with nothing decoding the whole step budget applies.

The budget changes only how prompts are split across steps, never what is computed: the
greedy outputs of the default model with and without it are compared in
test_scheduler_long_prefill.py, beside the per-request cap's.
"""

from __future__ import annotations

import random

import pytest

from pagedserve import SamplingParams
from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.scheduler import Scheduler

BS = 4


def make(with_decodes: int | None, threshold: int | None = 0, budget: int = 64, default: int = 0) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_prefill_tokens_with_decodes=with_decodes,
    )
    return Scheduler(cfg, KVCacheManager(512, BS, enable_prefix_caching=False), 512, default_long_prefill=default)


def req(rid: str, n_prompt: int, start: int = 0, max_tokens: int = 30) -> Request:
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> tuple[dict[str, int], int, int]:
    """One step: ({request: tokens}, prompt tokens, decode rows)."""
    out = s.schedule()
    prompt = sum(x.num_new_tokens for x in out.scheduled if x.request.num_computed_tokens < x.request.num_prompt_tokens)
    decodes = sum(1 for x in out.scheduled if x.request.num_computed_tokens >= x.request.num_prompt_tokens)
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
    s.update_after_step(out, sampled)
    for r in list(s.running):
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}, prompt, decodes


def test_prompt_tokens_beside_decodes_stay_under_the_budget():
    s = make(with_decodes=12)
    s.add_request(req("short", 6))
    assert step(s)[0] == {"short": 6}  # nothing decodes yet: the whole prompt
    s.add_request(req("a", 20, start=100))
    s.add_request(req("b", 9, start=200))
    steps = [step(s)[0] for _ in range(4)]
    assert [x["short"] for x in steps] == [1, 1, 1, 1]  # the decode runs every step
    # Oldest first: a's chunks, then b takes what is left of the 12 tokens.
    assert [x.get("a") for x in steps] == [12, 8, 1, 1]
    assert [x.get("b") for x in steps] == [None, 4, 5, 1]


def test_with_nothing_decoding_the_whole_step_budget_applies():
    s = make(with_decodes=12, budget=64)
    for i, n in enumerate((20, 30, 10)):
        s.add_request(req(f"p{i}", n, start=100 * i))
    tokens, prompt, decodes = step(s)
    assert tokens == {"p0": 20, "p1": 30, "p2": 10} and prompt == 60 and decodes == 0


def test_zero_means_no_cap():
    s = make(with_decodes=0)
    s.add_request(req("short", 6))
    step(s)
    s.add_request(req("a", 40, start=100))
    assert step(s)[0] == {"short": 1, "a": 40}


def test_random_arrivals_never_starve_and_never_exceed_the_budget():
    """Prompts arrive while others decode: every step with decodes computes at most the
    budget of prompt tokens, yet at least one while any prompt is pending, so every
    request finishes; no block is left allocated."""
    rng = random.Random(0)
    cap = 10
    s = make(with_decodes=cap, threshold=None, default=8, budget=48)
    pending = [(rng.randrange(40), rng.randint(1, 60), rng.randint(1, 12)) for _ in range(30)]
    pending.sort()
    for t in range(2000):
        while pending and pending[0][0] <= t:
            _, n_prompt, n_out = pending.pop(0)
            s.add_request(req(f"r{len(s.requests)}-{t}", n_prompt, start=rng.randrange(1000), max_tokens=n_out))
        had_prompt = any(r.num_computed_tokens < r.num_prompt_tokens for r in [*s.running, *s.waiting])
        tokens, prompt, decodes = step(s)
        if decodes:
            assert prompt <= cap
        if had_prompt:
            assert prompt > 0  # prompts progress every step
        if not pending and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.kv.num_blocks_in_use == 0


def test_settings_and_defaults():
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes must be >= 0"):
        SchedulerConfig(max_prefill_tokens_with_decodes=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        SchedulerConfig(max_prefill_tokens_with_decodes=64, enable_chunked_prefill=False)
    SchedulerConfig(max_prefill_tokens_with_decodes=0, enable_chunked_prefill=False)  # no cap: fine
    # Unset: the platform's long-prefill default (what a step's prompt chunk may cost).
    assert make(None, default=16).max_prefill_tokens_with_decodes == 16
    assert make(None, default=0).max_prefill_tokens_with_decodes == 0
    assert make(24, default=16).max_prefill_tokens_with_decodes == 24
    assert make(0, default=16).max_prefill_tokens_with_decodes == 0
