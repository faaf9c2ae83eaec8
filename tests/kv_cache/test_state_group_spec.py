"""Recurrent-state groups under speculative decoding, without a model: a verification
step takes one set of state pages per draft (the states after each position that may
end the accepted run), the step's metadata lists them as captures at their offsets,
and after verification the request keeps the pages of the state at its last accepted
token (its own when all were accepted), frees the rest, and caches as a checkpoint the
state at a boundary that an accepted draft crossed."""

from __future__ import annotations

import pytest

from pagedserve.kv_cache.kv_groups import RECURRENT_STATE, GroupedKVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

BS, PAGES = 4, 2
S = RECURRENT_STATE


def _decoding(kv: GroupedKVCacheManager, n_prompt: int = 10) -> Request:
    """A request that computed its prompt and sampled one token (next: verify drafts)."""
    r = Request("a", list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=100, ignore_eos=True))
    assert kv.allocate_slots(r, n_prompt) is not None
    kv.state_step(r)
    kv.take_transfers()
    r.num_computed_tokens = n_prompt
    r.append_token(50)
    return r


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_verification_keeps_the_state_at_the_last_accepted_token(accepted):
    kv = GroupedKVCacheManager(40, BS, False, [None, S], state_pages=PAGES)
    r = _decoding(kv)
    own = kv.block_ids("a")[1]
    r.spec_token_ids = [60, 61, 62]
    free_before = kv.pool.num_free_blocks
    new = kv.allocate_slots(r, 4)
    assert new is not None
    # Attention: tokens 10..13 need block 3 (already held for 10, 11) -> 1 new; state: 3 x 2 pages.
    assert len(new) == 1 + 3 * PAGES and kv.pool.num_free_blocks == free_before - len(new)
    step = kv.state_step(r)
    assert [off for off, _ in step.captures] == [1, 2, 3]  # after the known token and after drafts 1, 2
    captured = [pages[1] for _, pages in step.captures]
    assert all(len(p) == PAGES for p in captured) and not set(own) & {b for p in captured for b in p}
    kv.take_transfers()
    # The scheduler's update: computed tokens, the accepted drafts appended, then trim.
    r.num_computed_tokens += 1 + accepted
    r.spec_token_ids = []
    for t in [60, 61, 62][:accepted]:
        r.append_token(t)
    kv.trim(r, r.num_computed_tokens)
    assert kv.block_ids("a")[1] == (list(captured[accepted]) if accepted < 3 else own)
    assert kv.group_blocks_held("a") == [-(-r.num_computed_tokens // BS), PAGES]
    kv.check_invariants()
    kv.free(r)
    assert kv.num_blocks_in_use == 0
    kv.check_invariants()


def test_drafts_need_their_pages_or_are_not_scheduled():
    # 1 attention block + 2 state pages held; 3 free pages: one more attention block fits,
    # but not 3 drafts x 2 pages.
    kv = GroupedKVCacheManager(1 + 1 + 2 + 4, BS, False, [None, S], state_pages=PAGES)
    r = _decoding(kv, n_prompt=4)
    assert kv.pool.num_free_blocks == 4
    r.spec_token_ids = [60, 61, 62]
    assert kv.allocate_slots(r, 4) is None
    assert kv.pool.num_free_blocks == 4  # nothing taken
    r.spec_token_ids = [60]
    assert kv.allocate_slots(r, 2) is not None  # 1 block + 2 pages
    assert kv.pool.num_free_blocks == 1
    kv.free(r)  # preempted or aborted before verification: the draft's pages go too
    assert kv.num_blocks_in_use == 0
    kv.check_invariants()


def test_a_boundary_crossed_by_accepted_drafts_becomes_a_checkpoint():
    # Checkpoints every 2 blocks (8 tokens); the prompt is 6 tokens, the sampled one the 7th:
    # drafts 8, 9, 10 cross the boundary at 8 tokens after the first draft.
    kv = GroupedKVCacheManager(40, BS, True, [None, S], state_pages=PAGES, state_checkpoint_interval=2)
    r = _decoding(kv, n_prompt=6)
    r.spec_token_ids = [60, 61, 62]
    assert kv.allocate_slots(r, 4) is not None
    step = kv.state_step(r)
    assert [off for off, _ in step.captures] == [1, 2, 3]  # no boundary among the known tokens
    at_8 = step.captures[1][1][1]  # the state after 8 tokens: the first draft accepted
    kv.take_transfers()
    r.num_computed_tokens += 1 + 2
    r.spec_token_ids = []
    r.append_token(60)
    r.append_token(61)
    kv.trim(r, r.num_computed_tokens)
    assert kv.state_groups[0].num_checkpoints == 1
    # The next step (the bonus token sampled) caches the attention block the drafts filled.
    r.append_token(70)
    assert kv.allocate_slots(r, 1) is not None
    kv.take_transfers()
    r.num_computed_tokens += 1
    kv.free(r)
    # A new request with the same first 9 tokens hits the checkpoint at 8: the pages captured there.
    b = Request("b", list(r.all_token_ids[:9]), SamplingParams(max_tokens=4, ignore_eos=True))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert [blk.block_id for blk in hits[1]] == list(at_8)
    kv.check_invariants()


def test_a_checkpoint_and_a_draft_position_at_one_offset():
    # The known token ends at the boundary (8 tokens): its checkpoint and the state kept
    # if no draft is accepted are both captured at offset 1, into different pages.
    kv = GroupedKVCacheManager(40, BS, True, [None, S], state_pages=PAGES, state_checkpoint_interval=2)
    r = _decoding(kv, n_prompt=7)
    r.spec_token_ids = [60, 61]
    assert kv.allocate_slots(r, 3) is not None
    step = kv.state_step(r)
    offsets = [off for off, _ in step.captures]
    assert offsets == [1, 1, 2]
    assert step.captures[0][1][1] != step.captures[1][1][1]
    kv.take_transfers()
    r.num_computed_tokens += 1
    r.spec_token_ids = []
    kv.trim(r, r.num_computed_tokens)  # both drafts rejected
    assert kv.state_groups[0].num_checkpoints == 1
    kv.free(r)
    assert kv.num_blocks_in_use == 0
    kv.check_invariants()
