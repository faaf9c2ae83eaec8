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


def _state_pages_cached(kv) -> dict[tuple, int]:
    """Per checkpoint (group, block key) the number of its pages cached now."""
    out: dict[tuple, int] = {}
    for block in kv.pool.cached.values():
        key = block.hash_key
        if len(key) == 4 and key[1] == "state":
            out[(key[0], key[3])] = out.get((key[0], key[3]), 0) + 1
    return out


def test_checkpoints_are_written_then_hit_at_their_boundaries():
    # Blocks of 4 tokens, a checkpoint every 2 blocks (8 tokens), 2 pages per state.
    kv = GroupedKVCacheManager(60, BS, True, [None, S, S], state_pages=2, state_checkpoint_interval=2)
    prompt = [random.Random(1).randrange(3, 200) for _ in range(20)]
    a = req("a", prompt)
    assert kv.get_computed_blocks(a) == ([[], [], []], 0)
    assert kv.allocate_slots(a, 20) is not None
    # 5 attention blocks, 2 own pages per state group, checkpoints at 8 and 16 tokens in both.
    assert kv.num_blocks_in_use == 5 + 2 * 2 + 2 * 2 * 2
    step = kv.state_step(a)
    assert step.copy_from == {} and [offset for offset, _ in step.captures] == [8, 16]
    assert all(set(pages) == {1, 2} and all(len(p) == 2 for p in pages.values()) for _, pages in step.captures)
    b = req("b", prompt[:18] + [7, 7, 7, 7, 7, 7])
    # Not written yet (this step's forward writes them): no hit in the same step.
    assert kv.get_computed_blocks(b)[1] == 0
    assert kv.take_transfers() is None  # the step is handed out: cached, references dropped
    assert kv.num_blocks_in_use == 5 + 2 * 2
    a.num_computed_tokens = 20
    hits, n = kv.get_computed_blocks(b)
    # 18 shared tokens: 4 full shared blocks, the checkpoint at block 4 (16 tokens).
    assert n == 16 and len(hits[0]) == 4 and all(len(h) == 2 for h in hits[1:])
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 8, hits) is not None
    step = kv.state_step(b)
    assert step.copy_from == {g: tuple(x.block_id for x in hits[g]) for g in (1, 2)}
    assert [offset for offset, _ in step.captures] == [24 - 16]  # its own boundary at 24 tokens
    assert kv.state_step(a) is None  # a's work was handed out with its step
    kv.take_transfers()
    kv.free(a)
    kv.free(b)
    assert kv.num_blocks_in_use == 0
    kv.check_invariants()
    assert set(_state_pages_cached(kv).values()) == {2} and len(_state_pages_cached(kv)) == 2 * 3


def test_evicting_a_checkpoint_page_forgets_the_checkpoint():
    kv = GroupedKVCacheManager(40, BS, True, [None, S], state_pages=3, state_checkpoint_interval=1)
    a = req("a", list(range(3, 19)))  # 16 tokens: checkpoints at 4, 8, 12, 16
    kv.allocate_slots(a, 16)
    kv.take_transfers()
    a.num_computed_tokens = 16
    kv.free(a)
    assert len(_state_pages_cached(kv)) == 4
    # A big request takes most of the pool, evicting some checkpoint pages: each checkpoint
    # is then either whole or forgotten, never partly cached.
    big = req("big", list(range(100, 196)))  # 24 blocks + 3 state pages
    assert kv.allocate_slots(big, 96) is not None
    counts = _state_pages_cached(kv)
    assert set(counts.values()) <= {3} and len(counts) < 4
    kv.take_transfers()
    kv.free(big)
    kv.check_invariants()


def test_scheduler_with_checkpoints_preempts_and_hits_without_leaks():
    kv = GroupedKVCacheManager(40, BS, True, [None, S, S], state_pages=2, state_checkpoint_interval=1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv, max_model_len=64)
    rng = random.Random(7)
    shared = [rng.randrange(3, 200) for _ in range(12)]
    reqs = [req(f"r{i}", shared + [rng.randrange(3, 200) for _ in range(1 + i * 3)], max_tokens=20) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for s in out.scheduled:
            assert kv.group_blocks_held(s.request.request_id)[1:] == [2, 2]
            if s.state is not None:  # captures at block ends inside the chunk
                assert all(0 < off <= s.num_new_tokens for off, _ in s.state.captures)
                assert all((s.request.num_computed_tokens + off) % BS == 0 for off, _ in s.state.captures)
        sampled = {s.request.request_id: rng.randrange(3, 200) for s in out.scheduled if s.samples}
        for r in sched.update_after_step(out, sampled):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert sched.num_preemptions > 0
    assert kv.prefix_hits > 0 and sum(r.num_cached_tokens for r in reqs) > 0
