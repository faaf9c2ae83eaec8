"""The KV manager frees blocks that slid out of a sliding window: table entries before
the first visible block point at the null block, held blocks stay bounded, freed full
blocks stay in the prefix cache, and nothing leaks (manager and scheduler, no model)."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.kv_cache.sliding_window import first_visible_block, max_blocks_held, uniform_window
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(kv: KVCacheManager, r: Request, n: int, next_token: int | None = None) -> None:
    """Allocate ``n`` tokens of ``r``, mark them computed and append a sampled token."""
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens += n
    if next_token is not None and r.num_computed_tokens == r.num_tokens:
        r.append_token(next_token)


def check_table(kv: KVCacheManager, r: Request, window: int, computed: int) -> None:
    """Entries before the first block visible to a step starting at token ``computed``
    (that of the latest allocation) are null; the rest are distinct pool blocks."""
    ids = kv.block_ids(r.request_id)
    first = first_visible_block(computed, window, BS)
    null = kv.null_block.block_id
    assert null == kv.pool.num_blocks  # outside the pool: never allocated
    assert all(b == null for b in ids[:first])
    live = [b for b in ids if b != null]
    assert len(live) == len(set(live)) and all(0 <= b < kv.pool.num_blocks for b in live)
    assert kv.num_blocks_held(r.request_id) == len(live)


def test_uniform_window_and_block_arithmetic():
    assert uniform_window([8, 8, 8]) == 8
    assert uniform_window([8, None, 8]) is None  # a full-attention layer needs every key
    assert uniform_window([8, 4]) is None
    assert uniform_window([None, None]) is None and uniform_window([]) is None
    # Before computing from token 10 with W=4, keys 7.. are visible: block 1 (tokens 4..7).
    assert first_visible_block(10, 4, BS) == 1
    assert first_visible_block(3, 8, BS) == 0
    # Decode (1 token a step) with W=8: keys c-7..c span at most 3 blocks of 4.
    assert max_blocks_held(10_000, BS, 8, 1) == 3
    assert max_blocks_held(10, BS, 8, 1) == 3 and max_blocks_held(6, BS, 8, 1) == 2
    assert max_blocks_held(10_000, BS, None, 1) == 2500


def test_max_blocks_held_is_the_exact_maximum_over_step_starts():
    rng = random.Random(0)
    for _ in range(300):
        n, bs, w, step_max = (
            rng.randrange(1, 120),
            rng.choice([1, 2, 4, 8, 16]),
            rng.randrange(1, 40),
            rng.randrange(1, 50),
        )
        brute = max(-(-(c + min(step_max, n - c)) // bs) - max(0, c - w + 1) // bs for c in range(n))
        assert max_blocks_held(n, bs, w, step_max) == brute, (n, bs, w, step_max)


def test_long_decode_holds_a_window_of_blocks_in_a_small_pool():
    w = 8
    kv = KVCacheManager(num_blocks=6, block_size=BS, sliding_window=w)  # 5 usable + null
    r = req("r", list(range(3, 13)))  # 10 prompt tokens
    step(kv, r, 10, next_token=50)
    rng = random.Random(0)
    bound = max_blocks_held(10**6, BS, w, 1)
    for _ in range(200):  # 200 tokens: 53 blocks without freeing
        step(kv, r, 1, next_token=rng.randrange(3, 250))
        check_table(kv, r, w, r.num_computed_tokens - 1)
        assert kv.num_blocks_held("r") <= bound
        kv.pool.check_invariants()
    assert len(kv.block_ids("r")) == -(-r.num_computed_tokens // BS)
    assert kv.peak_blocks_in_use <= 5
    r.status = RequestStatus.FINISHED_LENGTH
    kv.free(r)
    assert kv.num_blocks_in_use == 0
    kv.pool.check_invariants()


@pytest.mark.parametrize("chunk", [3, 8, 13])  # shorter than, equal to and longer than W
def test_chunked_prefill_holds_the_chunk_and_the_window(chunk):
    w = 8
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=w)
    r = req("r", list(range(3, 63)))  # 60 tokens
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        start = r.num_computed_tokens
        step(kv, r, n)
        ids = kv.block_ids("r")
        # Every block this step's queries see is a real block: first visible .. last.
        first = first_visible_block(start, w, BS)
        assert all(b != kv.null_block.block_id for b in ids[first:])
        assert kv.num_blocks_held("r") <= max_blocks_held(60, BS, w, chunk)
    kv.pool.check_invariants()


def test_slid_out_blocks_stay_cached_and_a_hit_skips_them():
    w = 8
    kv = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=w)
    prompt = list(range(3, 43))  # 40 tokens: 10 full blocks
    a = req("a", prompt)
    for _ in range(10):
        step(kv, a, 4)
    step(kv, a, 0)  # frees what the last chunk slid out
    assert kv.num_blocks_held("a") <= 4
    # A second prompt sharing the 40 tokens walks the chain from block 0: every block
    # is still cached, even the ones "a" freed.
    b = req("b", prompt + [7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40 and len(hits) == 10
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 3, hits) is not None
    # The hits that already slid out of b's window are not taken (ref_cnt unchanged).
    lead = first_visible_block(40, w, BS)
    assert lead == 8
    assert all(h.ref_cnt == 0 for h in hits[:lead])
    assert kv.block_ids("b")[:lead] == [kv.null_block.block_id] * lead
    assert kv.block_ids("b")[lead:10] == [h.block_id for h in hits[lead:]]
    kv.pool.check_invariants()


def test_a_hit_stops_at_an_evicted_block():
    w = 4
    kv = KVCacheManager(num_blocks=7, block_size=BS, sliding_window=w)  # 6 usable
    prompt = list(range(3, 27))  # 24 tokens = 6 blocks
    a = req("a", prompt)
    for _ in range(6):
        step(kv, a, 4)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    # Block 0 of the chain was freed first, so it is evicted first.
    c = req("c", list(range(100, 104)))
    step(kv, c, 4)
    hits, n = kv.get_computed_blocks(req("d", prompt + [1]))
    assert n == 0 and hits == []  # later blocks are cached, but the chain is broken


def test_trim_after_rejected_drafts_keeps_null_entries():
    w = 8
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=w)
    r = req("r", list(range(3, 23)))  # 20 tokens
    step(kv, r, 20, next_token=9)
    r.spec_token_ids = [1, 2, 3, 4, 5, 6]
    assert kv.allocate_slots(r, 7) is not None  # the sampled token and 6 drafts
    held = kv.num_blocks_held("r")
    r.num_computed_tokens += 7 - 6  # every draft rejected
    kv.trim(r, r.num_computed_tokens)
    r.spec_token_ids = []
    assert kv.num_blocks_held("r") < held
    check_table(kv, r, w, 20)
    kv.pool.check_invariants()


def test_request_longer_than_the_pool_is_admitted_when_its_window_fits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=8)
    assert kv.can_fit(200, max_step_tokens=8)
    assert not kv.can_fit(200, max_step_tokens=40)  # one step would need 12 blocks
    assert not KVCacheManager(num_blocks=8, block_size=BS).can_fit(200, max_step_tokens=8)


def test_scheduler_many_requests_preemption_no_leaks_bounded_blocks():
    """Random prompts and lengths through the scheduler in a pool too small for all of
    them: preemption happens, each request's held blocks stay within its bound, and the
    pool is whole at the end."""
    w, budget = 12, 16
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=True, sliding_window=w)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    s = Scheduler(cfg, kv, max_model_len=4096)
    rng = random.Random(1)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    for i in range(12):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]
        s.add_request(req(f"r{i}", (shared if i % 2 else []) + tail, max_tokens=rng.randrange(20, 120)))
    bound = max_blocks_held(10**6, BS, w, budget)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        steps += 1
        assert steps < 5000
        for x in out.scheduled:
            assert kv.num_blocks_held(x.request.request_id) <= bound
            check_table(kv, x.request, w, x.request.num_computed_tokens)
        sampled = {x.request.request_id: rng.randrange(3, 250) for x in out.scheduled if x.samples}
        for r in s.update_after_step(out, sampled):
            st = r.check_stop_by_token()
            if st is not None:
                s.finish_request(r.request_id, st)
        kv.pool.check_invariants()
    assert s.num_preemptions > 0
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert kv.prefix_hits > 0


def test_engine_rule_and_pool_sizing():
    from pagedserve.config import CacheConfig, EngineConfig
    from pagedserve.config_rules import check_sliding_window_cache
    from pagedserve.kv_cache.sliding_window import blocks_for_one_request, kv_window_for_pool

    cfg = EngineConfig()
    assert check_sliding_window_cache(cfg, 8) == 8 and check_sliding_window_cache(cfg, None) is None
    cfg.cache.free_sliding_window_blocks = False
    assert check_sliding_window_cache(cfg, 8) is None
    cfg.cache = CacheConfig(kv_offload_memory="1MiB")
    with pytest.raises(ValueError, match="free_sliding_window_blocks"):
        check_sliding_window_cache(cfg, 8)
    sched = SchedulerConfig(max_num_batched_tokens=16)
    cache = CacheConfig(block_size=BS)
    # 4096 tokens need 1024 blocks; with a window of 8 and steps of 16: 7 + the null block.
    assert blocks_for_one_request(cache, sched, 4096, [8, 8]) == max_blocks_held(4096, BS, 8, 16) + 1 == 8
    assert blocks_for_one_request(cache, sched, 4096, [8, None]) == 1024  # hybrid: every block
    assert kv_window_for_pool(8, 8, cache, sched, 4096) == 8
    # A pool with no room left for the null block keeps every block.
    assert kv_window_for_pool(8, 7, cache, sched, 4096) is None


def test_which_models_free_blocks():
    """Only models whose layers all share one window free blocks; hybrids keep them all."""
    from pagedserve.models.layers import layer_windows

    def window(hf: dict, n: int = 4) -> int | None:
        return uniform_window(layer_windows({"max_position_embeddings": 4096, **hf}, n))

    assert window({"sliding_window": 512}) == 512  # Mistral v0.1, Starcoder2, Mixtral
    assert window({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 0}) == 512
    assert window({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2}) is None
    alternating = ["sliding_attention", "full_attention"] * 2  # Gemma 2
    assert window({"sliding_window": 512, "layer_types": alternating}) is None
    assert window({"sliding_window": 512, "use_sliding_window": False}) is None
    assert window({"sliding_window": 8192}) is None  # never slides within the context
