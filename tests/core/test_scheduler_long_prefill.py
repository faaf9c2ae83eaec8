"""long_prefill_token_threshold: a long prompt goes in capped chunks beside the decodes.

The cap changes only how a prompt is split across steps, never what is computed: the
greedy outputs (and their logprobs) of the default model are the same with and without it,
and so are they with and without max_prefill_tokens_with_decodes (its scheduling is tested
in test_scheduler_prefill_budget.py).
"""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.interface import Platform
from pagedserve.request import Request
from pagedserve.scheduler import Scheduler

BS = 4


def make(threshold: int | None, budget: int = 64, default: int = 0, chunked: bool = True) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, KVCacheManager(128, BS, enable_prefix_caching=True), 512, default_long_prefill=default)


def req(rid: str, n_prompt: int, start: int = 0, max_tokens: int = 30) -> Request:
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
    s.update_after_step(out, sampled)
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_long_prompts_go_in_capped_chunks_beside_decodes():
    s = make(threshold=16)
    s.add_request(req("short", 10))
    assert step(s) == {"short": 10}  # under the cap: whole
    s.add_request(req("long", 50, start=100))
    s.add_request(req("long2", 20, start=300))
    steps = [step(s) for _ in range(4)]
    assert [x["short"] for x in steps] == [1, 1, 1, 1]  # the decode runs every step
    assert [x["long"] for x in steps] == [16, 16, 16, 2]
    # The budget (64) has room for both prompts, each under its own cap.
    assert [x["long2"] for x in steps] == [16, 4, 1, 1]  # then it decodes too


def test_zero_or_unset_means_no_cap():
    for threshold in (0, None):
        s = make(threshold)
        s.add_request(req("long", 50))
        assert step(s) == {"long": 50}


def test_settings_are_checked():
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        SchedulerConfig(long_prefill_token_threshold=64, enable_chunked_prefill=False)
    SchedulerConfig(long_prefill_token_threshold=0, enable_chunked_prefill=False)  # no cap: fine


def test_platform_default_applies_only_when_unset():
    assert Platform.default_long_prefill_token_threshold == 0  # other platforms keep whole-budget chunks
    assert CpuPlatform.default_long_prefill_token_threshold > 0
    assert make(None, default=16).long_prefill_token_threshold == 16
    assert make(0, default=16).long_prefill_token_threshold == 0
    assert make(24, default=16).long_prefill_token_threshold == 24
    # Without chunked prefill a prompt is never split, whatever the platform says.
    assert make(None, default=16, chunked=False).long_prefill_token_threshold == 0


@pytest.fixture(scope="module")
def llm():
    # The scheduling settings must not change outputs where each row's arithmetic does
    # not depend on how its prompt is chunked.  Kernels chosen per chunk length (AMX
    # prefill attention, measured dispatch) do depend on it (docs/kernels_cpu.md,
    # "Chunking invariance"), so this engine keeps the static, chunk-invariant kernels.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CPU_AMX_ATTENTION", "0")
        mp.setenv("PAGEDSERVE_CPU_TUNE", "0")
        # No prefix caching: a second run over the same prompts must compute them again.
        return LLM(max_model_len=1024, kv_cache_memory="64MiB", seed=0, enable_prefix_caching=False)


def test_engine_takes_the_platform_default(llm):
    expected = llm.llm_engine.platform.default_long_prefill_token_threshold
    assert llm.llm_engine.scheduler.long_prefill_token_threshold == expected


def test_engine_takes_the_platform_default_budget(llm):
    expected = llm.llm_engine.platform.default_long_prefill_token_threshold
    assert llm.llm_engine.scheduler.max_prefill_tokens_with_decodes == expected


def outputs_under(llm, monkeypatch, prompts, setting: str, values: tuple[int, int], measure) -> dict[int, int]:
    """Generate ``prompts`` greedily once per value of the scheduler's ``setting``, assert
    the two runs give the same tokens and logprobs, and return per value the largest
    ``measure(scheduled rows)`` over the run's steps."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    most = [0]

    def recording_schedule():
        out = schedule()
        most[0] = max(most[0], measure(out.scheduled))
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    results, peaks = {}, {}
    for value in values:
        monkeypatch.setattr(scheduler, setting, value)
        most[0] = 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[value] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        peaks[value] = most[0]
    for (ids0, lp0), (ids1, lp1) in zip(*results.values()):
        assert ids0 == ids1
        for t, x, y in zip(ids0, lp0, lp1):
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=2e-2)
    return peaks


def test_greedy_outputs_do_not_depend_on_the_cap(llm, monkeypatch):
    """The default model, prompts of 20-300 tokens arriving together: whole vs 32-token chunks."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 20, 170, 64, 250)]
    peaks = outputs_under(
        llm,
        monkeypatch,
        prompts,
        "long_prefill_token_threshold",
        (0, 32),
        lambda rows: max(s.num_new_tokens for s in rows),
    )
    assert peaks == {0: 300, 32: 32}


def test_greedy_outputs_do_not_depend_on_the_budget(llm, monkeypatch):
    """Prompts of 20-300 tokens arriving together in 32-token chunks, so the short ones
    decode while the long ones still prefill: no budget vs 24 prompt tokens beside decodes."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 20, 170, 30, 250)]
    monkeypatch.setattr(llm.llm_engine.scheduler, "long_prefill_token_threshold", 32)

    def prompt_tokens_beside_decodes(rows) -> int:
        in_prompt = [s.request.num_computed_tokens < s.request.num_prompt_tokens for s in rows]
        if all(in_prompt):
            return 0
        return sum(s.num_new_tokens for s, p in zip(rows, in_prompt) if p)

    peaks = outputs_under(
        llm, monkeypatch, prompts, "max_prefill_tokens_with_decodes", (0, 24), prompt_tokens_beside_decodes
    )
    assert peaks == {0: 96, 24: 24}
