"""Scheduler: token budget, chunking, preemption, abort, fairness (no model needed)."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, policy="fcfs", caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, policy=policy
    )
    return Scheduler(cfg, kv, max_model_len=512)


def req(rid, n_prompt, max_tokens=8, arrival=0.0, priority=0, start=0):
    toks = list(range(start, start + n_prompt))
    return Request(
        rid, toks, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival, priority=priority
    )


def run_step(s: Scheduler, rng: random.Random | None = None):
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    sampled = {x.request.request_id: (rng.randrange(500) if rng else 7) for x in out.scheduled if x.samples}
    done = []
    for r in s.update_after_step(out, sampled):
        st = r.check_stop_by_token()
        if st is not None:
            s.finish_request(r.request_id, st)
            done.append(r.request_id)
    return out, done


def test_budget_and_chunked_prefill_do_not_stall_decodes():
    s = make(budget=16)
    s.add_request(req("short", 3, max_tokens=20, arrival=0))
    run_step(s)  # short prefilled
    s.add_request(req("long", 50, arrival=1, start=100))
    chunks = []
    while s.requests["long"].num_computed_tokens < 50:
        out, _ = run_step(s)
        ids = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
        assert ids.get("short") == 1  # the decode goes on every step
        chunks.append(ids["long"])
        assert out.num_batched_tokens <= 16
    assert chunks == [15, 15, 15, 5]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(budget=16, chunked=False)
    s.add_request(req("a", 10, arrival=0))
    s.add_request(req("b", 10, arrival=1, start=100))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]
    out, _ = run_step(s)  # b is scheduled whole, next to a's decode
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 10)]
    chunked = make(budget=16)
    chunked.add_request(req("a", 10, arrival=0))
    chunked.add_request(req("b", 10, arrival=1, start=100))
    out, _ = run_step(chunked)  # the default splits b to fill the step
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10), ("b", 6)]


def test_without_chunking_a_request_longer_than_the_budget_is_chunked_not_starved():
    # Admission refuses such prompts; a request preempted by recompute after it grew past
    # the budget is the one way to get here, and it must not wait forever.
    s = make(budget=16, chunked=False)
    s.add_request(req("big", 20))
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [16]
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [4]


def test_preemption_frees_latest_arrival_and_it_resumes():
    s = make(num_blocks=6, budget=64)
    s.add_request(req("a", 8, max_tokens=12, arrival=0))
    s.add_request(req("b", 8, max_tokens=12, arrival=1, start=50))
    run_step(s)
    preempted = []
    finished = []
    for _ in range(60):
        out, done = run_step(s)
        preempted += out.preempted
        finished += done
        s.kv.pool.check_invariants()
        if not s.has_unfinished():
            break
    assert "b" in preempted and "a" not in preempted
    assert sorted(finished) == ["a", "b"]
    assert s.num_preemptions >= 1
    assert s.kv.pool.num_in_use == 0


@pytest.mark.compat("priority", "single")
def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    s = make(num_blocks=64, budget=8, max_seqs=1, policy="priority")
    s.add_request(req("low", 4, arrival=0, priority=5))
    s.add_request(req("high", 4, arrival=1, priority=0, start=10))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["high"]


def test_abort_at_any_moment_frees_blocks():
    s = make(budget=8)
    for i in range(4):
        s.add_request(req(f"r{i}", 10, arrival=i, start=20 * i))
    run_step(s)
    run_step(s)
    # one running mid-prefill, others waiting
    for rid in list(s.requests):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished()
    assert s.kv.pool.num_in_use == 0
    s.kv.pool.check_invariants()
    assert s.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None


def test_max_num_seqs_respected_and_no_request_starves():
    rng = random.Random(7)
    s = make(num_blocks=30, budget=24, max_seqs=3)
    n = 12
    for i in range(n):
        s.add_request(req(f"r{i}", rng.randrange(2, 20), max_tokens=rng.randrange(1, 10), arrival=i, start=i * 50))
    finished_order = []
    for _ in range(400):
        out, done = run_step(s, rng)
        assert len(s.running) <= 3
        finished_order += done
        s.kv.pool.check_invariants()
        if not s.has_unfinished():
            break
    assert sorted(finished_order) == sorted(f"r{i}" for i in range(n))
    assert s.kv.pool.num_in_use == 0


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("x", 3))


def test_prompt_larger_than_cache_rejected_clearly():
    s = make(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("huge", 20))
