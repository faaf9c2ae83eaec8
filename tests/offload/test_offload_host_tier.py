"""Host KV tier bookkeeping without a model: spill on eviction, reload on a host hit,
host LRU, swap-out/swap-in, pins, and no reference leaked across the two pools."""

from __future__ import annotations

import random

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.host_tier import KVTransfers, TieredKVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


def run_whole(kv: TieredKVCacheManager, r: Request) -> None:
    """Schedule a whole prompt at once and mark it computed."""
    blocks, n = kv.get_computed_blocks(r)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, r.num_tokens - n, blocks) is not None
    r.num_computed_tokens = r.num_tokens


def finish(kv: TieredKVCacheManager, r: Request) -> None:
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)


def pairs(t: KVTransfers | None, direction: str) -> list[tuple[int, int]]:
    return [p for d, ps in (t.runs if t else []) if d == direction for p in ps]


def test_evicted_cached_block_spills_and_a_later_hit_reloads_it():
    kv = TieredKVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    a = req("a", list(range(9)))  # 2 full blocks + 1 token: 3 device blocks
    run_whole(kv, a)
    finish(kv, a)
    a_blocks = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert len(a_blocks) == 2
    assert kv.take_transfers() is None  # nothing evicted yet
    # 4 fresh blocks: every block is taken, so a's two cached blocks are evicted.
    b = req("b", list(range(100, 116)))
    run_whole(kv, b)
    t = kv.take_transfers()
    spilled = pairs(t, "out")
    assert sorted(src for src, _ in spilled) == sorted(blk.block_id for blk in a_blocks)
    assert kv.num_spilled_blocks == 2 and len(kv.host.cached) == 2
    finish(kv, b)
    kv.check_invariants()

    # A request sharing a's prefix misses on device and hits on host.
    c = req("c", list(range(8)) + [50, 51])
    blocks, n = kv.get_computed_blocks(c)
    assert blocks == [] and n == 8
    c.num_computed_tokens = n
    new = kv.allocate_slots(c, c.num_tokens - n, blocks)
    assert new is not None and len(new) == 3
    t = kv.take_transfers()
    loads = pairs(t, "in")
    host_ids = {blk.block_hash: blk.block_id for blk in kv.host.cached.values()}
    assert loads == [(host_ids[blk.block_hash], dst.block_id) for blk, dst in zip(a_blocks, new)]
    assert kv.num_reloaded_tokens == 8 and kv.num_scheduled_tokens == 9 + 16 + 2
    # The reloaded blocks are registered on device again: a device hit next time.
    c.num_computed_tokens = c.num_tokens
    finish(kv, c)
    d = req("d", list(range(8)) + [60, 61])
    blocks, n = kv.get_computed_blocks(d)
    assert [blk.block_id for blk in blocks] == [blk.block_id for blk in new[:2]] and n == 8
    kv.check_invariants()


def test_spill_order_is_kept_when_a_block_is_spilled_then_reused_in_one_step():
    # The spilled block is reused by the same allocation: its copy-out must come
    # before anything written to it, which the executor guarantees by running the
    # recorded runs in order, before the forward.
    kv = TieredKVCacheManager(num_blocks=2, block_size=BS, num_host_blocks=4)
    a = req("a", list(range(5)))
    run_whole(kv, a)
    finish(kv, a)
    b = req("b", list(range(20, 27)))
    run_whole(kv, b)
    t = kv.take_transfers()
    assert [d for d, _ in t.runs] == ["out"]
    assert pairs(t, "out")[0][0] in kv.block_ids("b")


def test_host_pool_is_lru_and_drops_spills_when_full_of_pinned_blocks():
    kv = TieredKVCacheManager(num_blocks=2, block_size=BS, num_host_blocks=2)
    hashes = []
    for i in range(4):  # each request leaves one cached full block that the next evicts
        r = req(f"r{i}", [1000 * i + j for j in range(5)])
        run_whole(kv, r)
        finish(kv, r)
        hashes.append(
            next(b.block_hash for b in kv.pool.blocks if b.block_hash is not None and b.hash_key[1][0] == 1000 * i)
        )
        kv.take_transfers()
    # 3 spills into 2 host blocks: the oldest was evicted from host (LRU).
    assert kv.num_spilled_blocks == 3
    assert hashes[0] not in kv.host.cached and hashes[1] in kv.host.cached and hashes[2] in kv.host.cached
    kv.check_invariants()
    # Pins: while two spills are pending (not yet taken), a third has no host room.
    kv2 = TieredKVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=2)
    for i in range(3):
        r = req(f"p{i}", [2000 * i + j for j in range(4)] + [7])
        blocks, n = kv2.get_computed_blocks(r)
        r.num_computed_tokens = n
        assert kv2.allocate_slots(r, r.num_tokens - n, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        finish(kv2, r)
    # The last allocation evicted two cached blocks (2 spills pending, host full).
    big = req("big", list(range(5000, 5012)))
    run_whole(kv2, big)
    assert kv2.num_spills_dropped >= 1
    kv2.check_invariants()
    kv2.take_transfers()
    finish(kv2, big)
    kv2.check_invariants()


def _scheduler(kv, budget=64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(cfg, kv, max_model_len=256)


def test_swap_preemption_keeps_computed_tokens_and_swaps_back_in():
    kv = TieredKVCacheManager(num_blocks=6, block_size=BS, num_host_blocks=16, swap_policy=lambda blocks, tokens: True)
    s = _scheduler(kv)
    a = req("a", list(range(10)))
    b = req("b", list(range(100, 110)))
    b.arrival_time = a.arrival_time + 1
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled) == 2  # 3 blocks each: the pool is full
    s.update_after_step(out, {"a": 1, "b": 2})
    # Decode until a needs a 4th block: the pool is out and b (the later arrival) is
    # preempted, by swap since the policy says so.
    for _step in range(4):
        out = s.schedule()
        if out.preempted:
            break
        s.update_after_step(out, {x.request.request_id: 3 for x in out.scheduled if x.samples})
    assert out.preempted == ["b"]
    assert kv.is_swapped("b") and b.num_computed_tokens > 0
    swapped_tokens = b.num_computed_tokens
    outs = pairs(out.kv_transfers, "out")
    assert len(outs) == -(-swapped_tokens // BS)
    kv.check_invariants()
    # Finish a: b swaps back in with its computed tokens kept (nothing recomputed).
    s.finish_request("a", RequestStatus.FINISHED_LENGTH)
    before = kv.num_scheduled_tokens
    out = s.schedule()
    (sb,) = out.scheduled
    assert sb.request is b and sb.num_new_tokens == b.num_tokens - swapped_tokens
    assert kv.num_scheduled_tokens - before == sb.num_new_tokens
    ins = pairs(out.kv_transfers, "in")
    assert [h for h, _ in ins] == [h for _, h in outs]
    assert [d for _, d in ins] == kv.block_ids("b")[: len(ins)]
    assert kv.num_swapped_in_tokens == swapped_tokens
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    kv.check_invariants()
    assert all(blk.ref_cnt == 0 for blk in kv.host.blocks)


def test_random_workload_with_aborts_leaks_nothing_in_either_tier():
    rng = random.Random(0)
    kv = TieredKVCacheManager(
        num_blocks=12, block_size=BS, num_host_blocks=16, swap_policy=lambda blocks, tokens: tokens % 2 == 0
    )
    s = _scheduler(kv, budget=24)
    prefixes = [[rng.randrange(3, 200) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for step in range(200):
        if rng.random() < 0.5:
            rid = f"r{step}"
            toks = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
            r = Request(rid, toks, SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True))
            s.add_request(r)
            live.append(rid)
        if live and rng.random() < 0.08:
            s.finish_request(live.pop(rng.randrange(len(live))), RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        sampled = {x.request.request_id: rng.randrange(3, 200) for x in out.scheduled if x.samples}
        for r in s.update_after_step(out, sampled):
            st = r.check_stop_by_token()
            if st is not None:
                s.finish_request(r.request_id, st)
                live.remove(r.request_id)
        kv.check_invariants()
    for rid in list(live):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    kv.take_transfers()
    kv.check_invariants()
    assert kv.pool.num_in_use == 0
    assert all(blk.ref_cnt == 0 for blk in kv.host.blocks)
    assert kv.num_spilled_blocks > 0 and kv.num_reloaded_tokens > 0
    assert 0 < kv.num_swap_outs < s.num_preemptions  # both kinds of preemption happened
