"""Block pool and KV cache manager: prefix hits, LRU eviction, ref counts, no leaks."""

from __future__ import annotations

import random

import pytest

from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def schedule_whole(kv: KVCacheManager, r: Request) -> list:
    blocks, n = kv.get_computed_blocks(r)
    r.num_computed_tokens = n
    new = kv.allocate_slots(r, r.num_tokens - n, blocks)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return blocks


def test_prefix_hit_reuses_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    schedule_whole(kv, a)
    b = req("b", list(range(8)) + [99, 98, 97])
    hit = schedule_whole(kv, b)
    assert [blk.block_id for blk in hit] == kv.block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in hit)
    # A prompt made exactly of cached blocks still recomputes its last token.
    c = req("c", list(range(8)))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 4 and len(blocks) == 1
    kv.pool.check_invariants()


def test_hit_requires_same_chain_and_salt():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    schedule_whole(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block but a different first block: no hit at all (chained hash).
    blocks, n = kv.get_computed_blocks(req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert n == 0 and blocks == []
    blocks, n = kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-2"))
    assert n == 0
    blocks, n = kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert n == 8


def test_hit_confirmed_by_key_not_hash_alone():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", [1, 2, 3, 4, 5])
    schedule_whole(kv, a)
    block = kv.req_blocks["a"][0]
    # Simulate a hash collision: a different key stored under the same hash value.
    block.hash_key = ("other",)
    blocks, n = kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5]))
    assert n == 0


def test_lru_eviction_order_and_tail_first_free():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(100, 109)))  # 3 blocks (2 full)
    b = req("b", list(range(200, 209)))
    schedule_whole(kv, a)
    schedule_whole(kv, b)
    a.status = b.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    kv.free(b)
    kv.pool.check_invariants()
    assert kv.pool.num_cached_unreferenced == 4
    # Allocating 3 fresh blocks evicts in LRU order: a's blocks first, tails before heads.
    c = req("c", list(range(300, 312)))
    schedule_whole(kv, c)
    # a's chain is gone (its head was evicted), b's chain is intact.
    assert kv.get_computed_blocks(req("a2", list(range(100, 109))))[1] == 0
    assert kv.get_computed_blocks(req("b2", list(range(200, 209))))[1] == 8


def test_allocate_returns_none_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(9)))
    schedule_whole(kv, a)
    b = req("b", list(range(50, 59)))
    before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 9) is None
    assert kv.pool.num_free_blocks == before
    assert "b" not in kv.req_blocks or kv.req_blocks["b"] == []
    kv.pool.check_invariants()


def test_random_workload_never_leaks_blocks():
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    live: list[Request] = []
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    for step in range(400):
        if live and rng.random() < 0.4:
            r = live.pop(rng.randrange(len(live)))
            r.status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED])
            kv.free(r)
        else:
            toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            r = req(f"r{step}", toks)
            blocks, n = kv.get_computed_blocks(r)
            r.num_computed_tokens = n
            if kv.allocate_slots(r, r.num_tokens - n, blocks) is not None:
                r.num_computed_tokens = r.num_tokens
                live.append(r)
                # decode a few tokens
                for _ in range(rng.randrange(5)):
                    r.append_token(rng.randrange(1000))
                    if kv.allocate_slots(r, 1) is None:
                        break
                    r.num_computed_tokens += 1
        kv.pool.check_invariants()
    for r in live:
        r.status = RequestStatus.FINISHED_ABORTED
        kv.free(r)
    kv.pool.check_invariants()
    assert kv.pool.num_in_use == 0
    assert kv.pool.num_free_blocks == 40
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_double_free_is_detected():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([blk])


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    schedule_whole(kv, req("a", list(range(10))))
    assert kv.get_computed_blocks(req("b", list(range(10)))) == ([], 0)
    assert kv.pool.cached == {}
