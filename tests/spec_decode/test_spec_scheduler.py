"""Drafts in the scheduler's token budget (no model): scheduled like prompt tokens, the
slots of rejected drafts given back, no prefix-cache block over unverified tokens,
drafts dropped (never split) when the budget or the blocks run short."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4


def make(num_blocks=64, budget=32):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, max_model_len=512)


def decoding(s: Scheduler, rid: str, prompt: list[int]) -> Request:
    """A request past its prefill, with its first token sampled."""
    r = Request(rid, prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    s.add_request(r)
    out = s.schedule()
    s.update_after_step(out, {x.request.request_id: 1000 for x in out.scheduled if x.samples})
    return r


def cached_spans(s: Scheduler) -> list[tuple[int, ...]]:
    return [b.hash_key[1] for b in s.kv.pool.cached.values()]


def test_drafts_scheduled_verified_and_rolled_back():
    s = make()
    r = decoding(s, "a", list(range(6)))  # 6 prompt tokens + 1 sampled = 7 tokens, 6 computed
    r.spec_token_ids = [2000, 2001, 2002, 2003, 2004]
    out = s.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.samples, item.spec_token_ids) == (6, True, [2000, 2001, 2002, 2003, 2004])
    assert len(s.kv.req_blocks["a"]) == 3  # 12 slots for 6 computed + 6 new
    # Only blocks full of verified tokens are cached: the first 4 prompt tokens.
    assert cached_spans(s) == [(0, 1, 2, 3)]
    # Two drafts accepted, then token 3000 sampled at the first mismatch.
    s.update_after_step(out, {"a": 3000}, {"a": [2000, 2001]})
    assert r.all_token_ids == list(range(6)) + [1000, 2000, 2001, 3000]
    assert r.num_computed_tokens == 9 and r.spec_token_ids == []
    assert len(s.kv.req_blocks["a"]) == 3  # slots 0..8 in blocks 0..2
    # The next step caches the block that the verified tokens now fill.
    r.spec_token_ids = [4000]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 2
    assert cached_spans(s) == [(0, 1, 2, 3), (4, 5, 1000, 2000)]
    s.update_after_step(out, {"a": 4001}, {"a": []})  # rejected
    assert r.num_computed_tokens == 10 and r.all_token_ids[-2:] == [3000, 4001]


def test_rejected_slots_free_whole_blocks():
    s = make()
    r = decoding(s, "a", list(range(3)))  # 4 tokens, 3 computed
    r.spec_token_ids = list(range(100, 108))  # 8 drafts: 12 slots = 3 blocks
    out = s.schedule()
    assert len(s.kv.req_blocks["a"]) == 3
    s.update_after_step(out, {"a": 500}, {"a": []})
    assert r.num_computed_tokens == 4
    assert len(s.kv.req_blocks["a"]) == 1
    assert s.kv.pool.num_in_use == 1
    s.finish_request("a", r.status.FINISHED_ABORTED)
    assert s.kv.pool.num_in_use == 0


def test_drafts_past_the_budget_are_dropped():
    s = make(budget=4)
    r = decoding(s, "a", list(range(3)))
    r.spec_token_ids = [7, 8, 9, 10, 11]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 4 and out.scheduled[0].spec_token_ids == [7, 8, 9]
    assert out.num_batched_tokens <= 4


def test_drafts_dropped_before_anyone_is_preempted():
    s = make(num_blocks=4)
    a = decoding(s, "a", list(range(6)))  # decodes while b prefills: 8 tokens, 7 computed, 2 blocks
    b = decoding(s, "b", list(range(50, 57)))  # 8 tokens, 7 computed, 2 blocks: the pool is full
    a.spec_token_ids = [1, 2, 3]  # would need a third block
    out = s.schedule()
    assert not out.preempted
    assert [(x.request.request_id, x.num_new_tokens, x.spec_token_ids) for x in out.scheduled] == [
        ("a", 1, []),
        ("b", 1, []),
    ]
    assert a.spec_token_ids == [] and b.num_computed_tokens == 7


def test_constrained_requests_hold_drafts_back():
    """While a request that may not share a step with drafts (structured outputs, pooling)
    runs or waits, no step carries drafts: the executor's own path then serves it."""
    from pagedserve.spec_config import parse_speculative_config
    from pagedserve.spec_decode.decoder import SpecDecoder
    from pagedserve.spec_decode.proposer import NgramProposer

    spec = SpecDecoder(
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}), None, NgramProposer(1, 3), 512
    )
    s = make()
    a = decoding(s, "a", [1000, 5, 6, 1000, 5, 6])  # then 1000 is sampled
    spec.propose(s.running)
    assert a.spec_token_ids == [5, 6, 1000]  # "6 1000" occurred before
    constrained = Request("c", [1, 2, 3], SamplingParams(max_tokens=4))
    constrained.pooling = "last"  # as an embedding request (or one with structured_outputs) is marked
    s.add_request(constrained)
    spec.hold_back(s.running, s.waiting)
    assert a.spec_token_ids == []
    out = s.schedule()
    assert all(not x.spec_token_ids for x in out.scheduled)
    s.update_after_step(out, {x.request.request_id: 9 for x in out.scheduled if x.samples})
    spec.propose(s.running)  # "c" is running now: nobody drafts
    assert a.spec_token_ids == []
