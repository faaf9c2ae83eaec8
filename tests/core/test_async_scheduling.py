"""async_scheduling gives exactly the synchronous engine's outputs: tokens, logprobs, stop
strings, n > 1 and best_of, streamed snapshots, aborts, preemption; no block leaks."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_kwargs


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """A synchronous and an async engine over the same weights."""
    kw = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8)
    return LLM(**kw), LLM(async_scheduling=True, **kw)


def _no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage() == 0
    engine.kv.pool.check_invariants()


def _same(a, b) -> None:
    """Two RequestOutputs agree in every sample: tokens, text, reasons, logprobs."""
    assert a.finished and b.finished
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert len(x.logprobs) == len(y.logprobs)
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                for tid in ex:
                    assert ex[tid].rank == ey[tid].rank
                    assert ex[tid].logprob == pytest.approx(ey[tid].logprob, abs=1e-5)
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)


def _workload(stop: str) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 4], [20, 21, 22], [30], [40, 41], [50, 51, 52]]
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=11, n=2, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=9, n=2, best_of=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=26, min_tokens=4, stop_token_ids=[60, 61, 62, 63]),
    ]
    return prompts, params


def _a_stop_string(llm: LLM) -> str:
    """Two characters from the middle of a greedy output, so that stop strings really stop."""
    text = llm.generate([[10, 11, 12, 13]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    text = text[0].outputs[0].text
    assert len(text) >= 12, text
    return text[8:10]


def test_outputs_equal_the_synchronous_engine(pair):
    sync, asyn = pair
    prompts, params = _workload(_a_stop_string(sync))
    want = sync.generate(prompts, params, use_tqdm=False)
    got = asyn.generate(prompts, params, use_tqdm=False)
    assert any(o.outputs[0].stop_reason is not None for o in want)  # a stop string fired
    for a, b in zip(want, got):
        _same(a, b)
        assert a.prompt_logprobs == b.prompt_logprobs or a.prompt_logprobs is None
    _no_leaks(sync)
    _no_leaks(asyn)


def _snapshots(llm: LLM, prompts, params, abort_at: dict[str, int] | None = None) -> dict[str, list]:
    """Every output each request produced, step by step (what a stream sends), aborting
    request ``rid`` once it has ``abort_at[rid]`` output tokens."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    abort_at = dict(abort_at or {})
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append([(o.text, list(o.token_ids), o.finish_reason) for o in out.outputs])
            limit = abort_at.get(out.request_id)
            if limit is not None and len(out.outputs[0].token_ids) >= limit:
                engine.abort_request(out.request_id)
                del abort_at[out.request_id]
    return seen


def test_streamed_snapshots_and_aborts_match(pair):
    sync, asyn = pair
    prompts, params = _workload(_a_stop_string(sync))
    # Without best_of the 8 sequences run together in both modes: with more sequences
    # than max_num_seqs, blocks freed by a stop string reach a waiting request one step
    # later under async scheduling, which splits its stream into other chunks.
    del prompts[4], params[4]
    abort = {"r1": 5, "r3": 3}
    want = _snapshots(sync, prompts, params, abort)
    got = _snapshots(asyn, prompts, params, abort)
    assert want == got
    assert all(not snaps[-1][0][2] for rid, snaps in want.items() if rid in abort)  # aborted mid-way
    _no_leaks(sync)
    _no_leaks(asyn)


def test_preemption_under_a_small_cache(tiny_llama):
    """Blocks run out: running requests are preempted and recomputed in both modes."""
    kw = dict(model=str(tiny_llama), dtype="float32", num_gpu_blocks_override=10, block_size=16, max_model_len=128)
    prompts = [[5 + i, 6 + i, 7 + i] * 10 for i in range(4)]  # 4 x 70 tokens: 20 blocks wanted
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sync, asyn = LLM(**kw), LLM(async_scheduling=True, **kw)
    want = sync.generate(prompts, params, use_tqdm=False)
    got = asyn.generate(prompts, params, use_tqdm=False)
    assert asyn.llm_engine.stats().num_preemptions > 0
    for a, b in zip(want, got):
        _same(a, b)
    _no_leaks(sync)
    _no_leaks(asyn)


def test_a_failing_forward_loses_no_outputs_and_no_blocks(pair, monkeypatch):
    """The forward raises once: the step raises, the caller aborts what ran; the outputs
    of the step before are returned by the next call."""
    _, asyn = pair
    engine = asyn.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen = []
    for _ in range(3):
        seen += engine.step()
    execute = engine.executor.execute
    monkeypatch.setattr(engine.executor, "execute", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.setattr(engine.executor, "execute", execute)
    engine.abort_request(engine.running_request_ids())
    while engine.has_unfinished_requests():
        seen += engine.step()
    seen += engine.step()  # carried outputs of the failed step
    finished = {o.request_id: o for o in seen if o.finished}
    assert finished["a"].outputs[0].finish_reason == "length"
    assert len(finished["a"].outputs[0].token_ids) == 2
    _no_leaks(asyn)


def test_refused_with_speculative_decoding_and_flag_generated():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling cannot be combined with speculative_config"):
        engine_config_from_kwargs(async_scheduling=True, speculative_config=spec)
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor/pipeline"):
        engine_config_from_kwargs(async_scheduling=True, tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert engine_config_from_kwargs(async_scheduling=True).scheduler.async_scheduling is True


def test_structured_outputs_match_on_the_default_model():
    """The grammar's matcher advances right after the forward, before the next bitmask."""
    from pagedserve import StructuredOutputsParams
    from pagedserve.loader.model_path import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    kw = dict(max_model_len=256, kv_cache_memory="32MiB", threads=1)
    regex = r"[0-9]{3}-[A-Z]{2}( [a-z]{2,5}){0,3}"
    params = [
        SamplingParams(
            temperature=1.0, seed=1, n=2, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)
        ),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["Write a code:", "Is the sky blue?", "Once upon a time"]
    want = LLM(**kw).generate(prompts, params, use_tqdm=False)
    got = LLM(async_scheduling=True, **kw).generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        _same(a, b)
    assert re.fullmatch(regex, want[0].outputs[0].text) and want[1].outputs[0].text in ("yes", "no")
