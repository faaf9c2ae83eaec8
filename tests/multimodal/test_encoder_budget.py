"""The scheduler's encoder budget (no model): a step starts encoding at most a budget of
image tokens, cutting a chunk before the image that does not fit; an image larger than
the budget is encoded alone; an image a request already encoded is free in its later
chunks; images held for prompts still being prefilled count against the same budget."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.multimodal import MultiModalItem
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler


def _scheduler(budget: int, encoder_budget: int, blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(blocks, 4, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    return Scheduler(cfg, kv, max_model_len=512, encoder_budget=encoder_budget)


def _request(rid: str, n: int, spans: list[tuple[int, int, str]], start: int = 3) -> Request:
    items = [MultiModalItem("image", off, length, h) for off, length, h in spans]
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=2, ignore_eos=True), mm_items=items)


def _step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update_after_step(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_chunk_is_cut_before_an_image_that_does_not_fit():
    s = _scheduler(budget=40, encoder_budget=20)
    s.add_request(_request("a", 40, [(2, 16, "x"), (18, 16, "y")]))
    assert _step(s) == {"a": 18}  # x (16) fits, y would make 32: cut before y
    assert _step(s) == {"a": 22}  # y now; x is already encoded


def test_image_larger_than_the_budget_runs_alone():
    s = _scheduler(budget=64, encoder_budget=8)
    s.add_request(_request("a", 30, [(4, 16, "x")]))
    s.add_request(_request("b", 30, [(1, 8, "z")], start=100))
    # x exceeds the whole budget: it is encoded alone; b gets only its text before z.
    assert _step(s) == {"a": 30, "b": 1}
    assert _step(s) == {"a": 1, "b": 29}  # a decodes; z fits a fresh step's budget


def test_two_requests_share_a_step_budget():
    s = _scheduler(budget=64, encoder_budget=20)
    s.add_request(_request("a", 20, [(0, 12, "x")]))
    s.add_request(_request("b", 20, [(4, 12, "y")], start=100))
    assert _step(s) == {"a": 20, "b": 4}  # b's image would pass the budget: b gets its text before it
    got = _step(s)
    assert got["b"] == 16


def test_held_images_count_until_their_prompt_passes_them():
    s = _scheduler(budget=8, encoder_budget=20)
    s.add_request(_request("a", 30, [(2, 16, "x")]))
    assert _step(s) == {"a": 8}  # starts x: 16 of 20 held
    s.add_request(_request("b", 12, [(0, 8, "y")], start=100))
    assert _step(s) == {"a": 8}  # y (8) does not fit beside x; b waits
    assert _step(s) == {"a": 8}  # a finishes x in this step (still held when it is scheduled)
    assert _step(s) == {"a": 6, "b": 2}  # x released: y starts (the step's 8 tokens shared)
