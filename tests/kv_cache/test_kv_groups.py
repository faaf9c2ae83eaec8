"""KV cache groups without a model: how layers are grouped, one block table per group over
one pool, slid-out blocks freed only in windowed groups, prefix hits valid in every group
(vLLM's sliding-window hit rule), all-or-nothing allocation, swap to a host tier, and no
leaks through the scheduler with preemption."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager, KVGroup, kv_cache_groups, layer_slots
from pagedserve.kv_cache.sliding_window import first_visible_block, max_blocks_held
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4
W = 8


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_grouping_follows_vllm():
    # Gemma 2: alternating, equal counts -> one full and one windowed group of 2 layers.
    assert kv_cache_groups([W, None, W, None]) == [KVGroup(None, (1, 3)), KVGroup(W, (0, 2))]
    # Gemma 3, 5 local : 1 global -> groups of 1 layer (the fewest of a type).
    groups = kv_cache_groups([W] * 5 + [None])
    assert [g.layers for g in groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert layer_slots(groups) == ([1, 2, 3, 4, 5, 0], [0] * 6)
    # 5 full, 6 windowed: 6 < 1.25 * 5, so groups of 6 (the full one padded by a slot).
    groups = kv_cache_groups([None] * 5 + [W] * 6)
    assert [g.layers for g in groups] == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9, 10)]
    assert layer_slots(groups)[1] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    # 3 full, 4 windowed: 4 >= 1.25 * 3, so groups of 3.
    assert [g.layers for g in kv_cache_groups([None] * 3 + [W] * 4)] == [(0, 1, 2), (3, 4, 5), (6,)]
    # Uniform, no window, or freeing off: one group of every layer (today's path).
    assert kv_cache_groups([W, W]) == [KVGroup(W, (0, 1))]
    assert kv_cache_groups([None, None]) == [KVGroup(None, (0, 1))]
    assert kv_cache_groups([W, None], free_slid_out=False) == [KVGroup(None, (0, 1))]


def test_windowed_group_frees_full_group_keeps():
    kv = GroupedKVCacheManager(40, BS, False, [None, W])
    r = req("a", list(range(3, 7)), max_tokens=100)
    assert kv.allocate_slots(r, 4) is not None
    r.num_computed_tokens = 4
    for t in range(40):
        r.append_token(10 + t)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        full, win = kv.block_ids("a")
        assert len(full) == len(win) == -(-r.num_computed_tokens // BS)
        assert kv.null_block.block_id not in full
        first = first_visible_block(r.num_computed_tokens - 1, W, BS)
        assert win[:first] == [kv.null_block.block_id] * first
        assert kv.group_blocks_held("a")[1] <= max_blocks_held(10_000, BS, W, 1)
        live = [b for b in full + win if b != kv.null_block.block_id]
        assert len(live) == len(set(live))  # the groups never share a block
    kv.free(r)
    assert kv.num_blocks_in_use == 0
    kv.check_invariants()


def test_allocation_is_all_groups_or_none():
    kv = GroupedKVCacheManager(6, BS, False, [None, W])  # 5 pool blocks
    r = req("a", list(range(3, 15)))  # 12 tokens: 3 blocks in each group
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert kv.allocate_slots(r, 8) is not None  # 2 + 2
    assert kv.num_blocks_in_use == 4


def test_a_group_never_takes_a_block_another_group_hit():
    """Hits of every group leave the free queue before any group takes new blocks."""
    kv = GroupedKVCacheManager(7, BS, True, [None, W])  # 6 pool blocks
    prompt = list(range(3, 12))  # 9 tokens: 2 full blocks + 1 partial per group
    a = req("a", prompt)
    assert kv.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    full_ids, win_ids = kv.block_ids("a")
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    # Put the windowed group's cached blocks at the head of the free queue.
    for block_id in full_ids + win_ids[2:]:
        block = kv.pool.blocks[block_id]
        kv.pool.free_queue.remove(block)
        kv.pool.free_queue.append(block)
    assert [b.block_id for b in kv.pool.free_queue][:2] == win_ids[:2][::-1]
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 1, hits) is not None
    full, win = kv.block_ids("b")
    assert full[:2] == full_ids[:2] and win[:2] == win_ids[:2]
    assert len(set(full + win)) == 6  # no block in two places
    kv.free(b)
    kv.check_invariants()


def test_prefix_hit_needs_only_the_window_in_windowed_groups():
    """A windowed group's blocks before the window may be evicted: the hit still holds."""
    kv = GroupedKVCacheManager(64, BS, True, [None, W])
    prompt = [random.Random(1).randrange(3, 200) for _ in range(33)]
    a = req("a", prompt)
    assert kv.allocate_slots(a, 33) is not None
    a.num_computed_tokens = 33
    a.append_token(5)
    kv.allocate_slots(a, 1)  # frees the windowed group's slid-out blocks (cached first)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    # Evict the windowed group's first blocks: its cached copies of blocks 0..2.
    win = kv.groups[1]
    for h in win._block_hashes(a, 12)[:3]:
        block = win._lookup(h)
        kv.pool.free_queue.remove(block)
        kv.pool._uncache(block)
        kv.pool.free_queue.append(block)
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 32  # 8 blocks: the last token's block is recomputed
    full, windowed = hits
    assert len(full) == len(windowed) == 8
    first = first_visible_block(32, W, BS)
    assert windowed[:first] == [kv.null_block] * first
    assert all(blk is not kv.null_block for blk in windowed[first:])
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.block_ids("b")[0][:8] == [blk.block_id for blk in full]
    # A shorter shared prefix: 5 blocks, whose window (blocks 3, 4) the windowed group holds.
    c = req("c", prompt[:20] + [7] * 13)
    assert kv.get_computed_blocks(c)[1] == 20
    # 3 blocks: the window would need block 1, evicted from the windowed group: no hit
    # (nor a shorter one: blocks 0 and 1 are gone too).
    d = req("d", prompt[:12] + [7] * 13)
    assert kv.get_computed_blocks(d)[1] == 0
    kv.free(b)
    kv.check_invariants()


def test_scheduler_runs_many_requests_without_leaks():
    """Long generations in a small pool: preemption, prefix hits and freeing, every
    block back at the end."""
    kv = GroupedKVCacheManager(48, BS, True, [None, W, W])
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv, max_model_len=64)
    rng = random.Random(3)
    shared = [rng.randrange(3, 200) for _ in range(12)]
    reqs = [req(f"r{i}", shared + [rng.randrange(3, 200) for _ in range(i * 3)], max_tokens=40) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for s in out.scheduled:
            held = kv.group_blocks_held(s.request.request_id)
            assert held[1] <= max_blocks_held(64, BS, W, 10) and held[2] <= max_blocks_held(64, BS, W, 10)
        sampled = {s.request.request_id: rng.randrange(3, 200) for s in out.scheduled if s.samples}
        for r in sched.update_after_step(out, sampled):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert sched.num_preemptions > 0 and kv.prefix_hits > 0


def test_too_small_for_one_request_is_refused_at_admission():
    kv = GroupedKVCacheManager(10, BS, False, [None, W])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("a", list(range(3, 40))))


def test_swap_moves_every_groups_live_pages_and_aborts_leak_nothing():
    """Swap-out copies a full group's computed blocks, a windowed group's visible ones and
    a state group's pages to host; swap-in rebuilds each table (leading null blocks in the
    windowed group) and copies them back into the first new pages; an abort while
    swapped, or before the copies are taken, gives every host page back."""
    from pagedserve.kv_cache.host_tier import IN, OUT
    from pagedserve.kv_cache.kv_groups import RECURRENT_STATE

    kv = GroupedKVCacheManager(
        64, BS, False, [None, W, RECURRENT_STATE], state_pages=2, num_host_blocks=40, swap_policy=lambda n, t: True
    )
    r = req("a", list(range(22)))
    assert kv.allocate_slots(r, 22) is not None
    r.num_computed_tokens = 22
    kv.take_transfers()
    full, windowed, state = kv.req_blocks["a"]
    first = first_visible_block(22, W, BS)
    live = [b.block_id for b in full[:6] + windowed[first:6] + state]
    assert first > 0 and kv.should_swap(r)
    kv.swap_out(r)
    assert kv.num_blocks_in_use == 0 and kv.is_swapped("a")
    kv.check_invariants()
    out = kv.take_transfers()
    assert [d for d, _ in out.runs] == [OUT] and [s for s, _ in out.runs[0][1]] == live
    host = [h for _, h in out.runs[0][1]]
    # Resume: 22 computed tokens stay, one more to compute.
    new = kv.allocate_slots(r, 1)
    assert new is not None and not kv.is_swapped("a")
    full, windowed, state = kv.req_blocks["a"]
    assert windowed[:first] == [kv.null_block] * first
    back = kv.take_transfers()
    assert [d for d, _ in back.runs] == [IN]
    assert back.runs[0][1] == list(zip(host, [b.block_id for b in full[:6] + windowed[first:6] + state]))
    assert kv.num_swap_outs == kv.num_swap_ins == 1 and kv.counters()["kv_blocks_swapped_in"] == len(live)
    kv.check_invariants()
    # Aborted while swapped out, once before its copies were taken and once after.
    for take_first in (False, True):
        kv.swap_out(r)
        if take_first:
            kv.take_transfers()
        r.status = RequestStatus.FINISHED_ABORTED
        kv.free(r)
        kv.check_invariants()
        kv.take_transfers()
        assert kv.host.num_in_use == 0 and kv.num_blocks_in_use == 0
        r.status = RequestStatus.RUNNING
        assert kv.allocate_slots(r, 1) is not None
