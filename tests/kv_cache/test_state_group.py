"""Recurrent-state KV cache groups without a model: grouping beside attention, a fixed
number of state pages per request from the shared pool (taken on the first allocation,
none after, all back on free), no prefix hits, the one-request size, and no leaks
through the scheduler with preemption."""

from __future__ import annotations

import random

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.kv_groups import (
    NO_KV_CACHE,
    RECURRENT_STATE,
    GroupedKVCacheManager,
    KVGroup,
    grouped_blocks_for_one_request,
    kv_cache_groups,
    layer_slots,
)
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4
S = RECURRENT_STATE


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_state_layers_group_apart_and_last():
    # Qwen3.5's 3 DeltaNet : 1 attention -> the attention group first, then one per state layer.
    groups = kv_cache_groups([S, S, S, None, S, S, S, None])
    assert groups[0] == KVGroup(None, (3, 7))
    assert [g.layers for g in groups[1:]] == [(0, 1), (2, 4), (5, 6)]
    assert all(g.is_state for g in groups[1:]) and not groups[0].is_state
    # Whatever free_sliding_window_blocks says (windowed attention then keeps every block).
    assert kv_cache_groups([S, 8, S, 8], free_slid_out=False) == [KVGroup(None, (1, 3)), KVGroup(S, (0, 2))]
    assert kv_cache_groups([S, S]) == [KVGroup(S, (0, 1))]
    # One request of 40 tokens: 10 attention blocks, 3 pages in each state group, the null block.
    assert grouped_blocks_for_one_request(kv_cache_groups([S, None, S, None]), BS, 40, 8, state_pages=3) == 14
    assert grouped_blocks_for_one_request(kv_cache_groups([S, S, S, None]), BS, 40, 8, state_pages=3) == 20


def test_layers_without_kv_belong_to_no_group():
    # Nemotron-H "M-*-M": its MLP layers keep nothing; they map to (group 0, slot 0), unread.
    groups = kv_cache_groups([S, NO_KV_CACHE, None, NO_KV_CACHE, S])
    assert groups == [KVGroup(None, (2,)), KVGroup(S, (0,)), KVGroup(S, (4,))]
    assert layer_slots(groups, 5) == ([1, 0, 0, 0, 2], [0, 0, 0, 0, 0])
    assert grouped_blocks_for_one_request(groups, BS, 40, 8, state_pages=3) == 1 + 10 + 3 + 3


def test_state_pages_are_fixed_per_request_and_freed():
    kv = GroupedKVCacheManager(30, BS, False, [None, S], state_pages=3)
    r = req("a", list(range(3, 9)), max_tokens=100)
    assert len(kv.allocate_slots(r, 6)) == 2 + 3
    attn, state = kv.block_ids("a")
    assert len(attn) == 2 and len(state) == 3 and not set(attn) & set(state)
    r.num_computed_tokens = 6
    for t in range(20):  # decoding grows the attention table only
        r.append_token(10 + t)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        assert kv.block_ids("a")[1] == state
        assert kv.group_blocks_held("a") == [-(-r.num_computed_tokens // BS), 3]
    kv.free(r)
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    kv.check_invariants()


def test_allocation_is_all_or_nothing_and_never_hits():
    kv = GroupedKVCacheManager(9, BS, True, [None, S], state_pages=4)  # 8 pages and the null block
    a = req("a", list(range(3, 15)))
    assert kv.get_computed_blocks(a) == ([[], []], 0)
    assert kv.allocate_slots(a, 12) is not None  # 3 + 4 pages
    b = req("b", list(range(3, 15)))  # the same prompt: its blocks are cached, the state is not
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and hits == [[], []]
    assert kv.allocate_slots(b, 1) is None  # 1 + 4 pages > 1 free: nothing taken
    assert kv.num_blocks_in_use == 7 and "b" not in kv.req_blocks
    assert not kv.can_fit(30) and kv.can_fit(16)


def test_scheduler_with_state_groups_preempts_without_leaks():
    kv = GroupedKVCacheManager(30, BS, False, [None, S, S], state_pages=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv, max_model_len=64)
    rng = random.Random(5)
    reqs = [req(f"r{i}", [rng.randrange(3, 200) for _ in range(5 + i * 4)], max_tokens=30) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for s in out.scheduled:
            assert kv.group_blocks_held(s.request.request_id)[1:] == [2, 2]
        sampled = {s.request.request_id: rng.randrange(3, 200) for s in out.scheduled if s.samples}
        for r in sched.update_after_step(out, sampled):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert sched.num_preemptions > 0
