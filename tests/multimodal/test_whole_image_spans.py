"""The scheduler's rule for images whose tokens attend to each other both ways (Gemma 3;
no model): a chunk never ends inside an image; it is cut before the image, or, when it
starts at (or, after a prefix-cache hit, inside) one, taken to the image's end past the
per-request prompt cap, within the step's budget."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.multimodal import MultiModalItem
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler


def _scheduler(budget: int, whole: bool = True, cap: int | None = None) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=True, long_prefill_token_threshold=cap
    )
    return Scheduler(cfg, kv, max_model_len=512, whole_image_spans=whole)


def _request(rid: str, n: int, spans: list[tuple[int, int, str]], start: int = 3) -> Request:
    items = [MultiModalItem("image", off, length, h) for off, length, h in spans]
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=2, ignore_eos=True), mm_items=items)


def _step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update_after_step(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_chunks_end_before_or_after_an_image():
    s = _scheduler(budget=10)
    s.add_request(_request("a", 30, [(4, 8, "x"), (12, 8, "y")]))
    assert _step(s) == {"a": 4}  # 10 would end inside x (4-12): cut before it
    assert _step(s) == {"a": 8}  # x whole; 10 would end inside y (12-20): cut before y
    assert _step(s) == {"a": 10}  # y whole and 2 text tokens
    assert _step(s) == {"a": 8}  # the rest


def test_without_the_rule_chunks_split_images():
    s = _scheduler(budget=10, whole=False)
    s.add_request(_request("a", 30, [(4, 8, "x")]))
    assert _step(s) == {"a": 10}


def test_an_image_passes_the_prompt_cap_but_not_the_budget():
    s = _scheduler(budget=16, cap=4)
    s.add_request(_request("a", 24, [(2, 12, "x")]))
    assert _step(s) == {"a": 2}  # the cap (4) would end inside x
    assert _step(s) == {"a": 12}  # x starts the chunk: taken whole past the cap
    assert _step(s) == {"a": 4}


def test_a_start_inside_an_image_runs_to_its_end():
    """As after a prefix-cache hit ending inside an image (its cached tokens were
    computed with the whole image): the chunk takes the image's remaining tokens."""
    s = _scheduler(budget=8)
    r = _request("a", 30, [(4, 12, "x")])
    s.add_request(r)
    r.num_computed_tokens = 8  # as a hit of two blocks would leave it
    assert _step(s) == {"a": 8}  # 8-16: the rest of x, exactly the budget
    s2 = _scheduler(budget=6)
    r2 = _request("b", 30, [(4, 12, "x")])
    s2.add_request(r2)
    r2.num_computed_tokens = 8
    assert _step(s2) == {}  # 8 more image tokens do not fit a step of 6: it waits
