"""The one chained block hash, and the manager's hand-off of cached blocks between engines."""

from __future__ import annotations

import random

import pytest

from pagedserve.kv_cache.block_hash import block_hashes, extend_block_hashes
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

BS = 4


def _schedule_whole(kv: KVCacheManager, r: Request) -> None:
    blocks, n = kv.get_computed_blocks(r)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, r.num_tokens - n, blocks) is not None
    r.num_computed_tokens = r.num_tokens


def test_chain_covers_every_earlier_block_and_the_salt():
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(20)]
    chain = block_hashes(tokens, BS, 5)
    assert len({h for h, _ in chain}) == 5
    changed = tokens[:]
    changed[1] += 1  # block 0 differs: every later hash differs too
    assert all(a[0] != b[0] for a, b in zip(chain, block_hashes(changed, BS, 5)))
    changed = tokens[:]
    changed[13] += 1  # block 3 differs: the blocks before it do not
    other = block_hashes(changed, BS, 5)
    assert other[:3] == chain[:3] and other[3][0] != chain[3][0] and other[4][0] != chain[4][0]
    salted = block_hashes(tokens, BS, 5, cache_salt="s")
    assert all(a[0] != b[0] for a, b in zip(chain, salted))
    # Extending a prefix of the chain gives the chain.
    assert extend_block_hashes(chain[:2], tokens, BS, 5) == chain
    with pytest.raises(ValueError, match="need 24 tokens; got 20"):
        block_hashes(tokens, BS, 6)


def test_manager_caches_blocks_under_the_same_chain():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    _schedule_whole(kv, Request("a", tokens, SamplingParams(max_tokens=2)))
    for i, (h, key) in enumerate(block_hashes(tokens, BS, 2)):
        assert kv.pool.lookup(h, key).block_id == kv.block_ids("a")[i]
    assert kv.cached_prefix(tokens, 2) == kv.block_ids("a")[:2]
    assert kv.cached_prefix([0] + tokens[1:], 2) == []


def test_adopted_prefix_is_a_hit_for_a_later_request_and_leaks_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(50, 63))  # 3 full blocks + 1 token
    rows, ids = kv.adopt_prefix(tokens, 3)
    assert rows == [0, 1, 2] and len(set(ids)) == 3
    assert kv.pool.num_in_use == 0  # cached but unreferenced: evictable
    assert kv.cached_prefix(tokens, 3) == ids
    assert kv.adopt_prefix(tokens, 3) == ([], [])  # already cached: nothing to adopt
    r = Request("r", tokens, SamplingParams(max_tokens=2))
    blocks, n = kv.get_computed_blocks(r)
    assert [b.block_id for b in blocks] == ids and n == 12
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, 1, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    kv.free(r)
    assert kv.pool.num_in_use == 0
    kv.pool.check_invariants()


def test_adopt_takes_no_more_blocks_than_are_free():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    hog = Request("hog", list(range(9)), SamplingParams(max_tokens=2))  # 3 blocks in use
    _schedule_whole(kv, hog)
    rows, ids = kv.adopt_prefix(list(range(200, 216)), 4)
    assert rows == [0] and len(ids) == 1
    kv.pool.check_invariants()
