"""benchmarks/serve_trace.py's attribution of client gaps to steps, and
benchmarks/prefill_budget_replay.py's priced replay of the real scheduler."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    # Loaded by path: putting benchmarks/ on sys.path would let its scripts shadow packages.
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(t0: float, length: float, decode=(), prefill=None, first=()) -> dict:
    return {
        "ev": "step",
        "t0": t0,
        "t_sched": t0,
        "t_fwd": t0 + length,
        "t_end": t0 + length,
        "decode": list(decode),
        "prefill": prefill or {},
        "first": list(first),
    }


def test_each_gap_is_split_into_its_step_the_time_between_and_delivery():
    trace = _load("serve_trace")
    steps = [
        _step(0.000, 0.010, prefill={"a": 8}, first=["a"]),
        _step(0.011, 0.010, decode=["a"]),
        _step(0.022, 0.100, decode=["a"], prefill={"b": 300}),  # a long prompt chunk beside a's decode
        _step(0.123, 0.010, decode=["a"], first=["b"], prefill={"b": 4}),
    ]
    # a's chunks arrive 1 ms after each of its steps ends, except the last (5 ms).
    chunks = [0.011, 0.022, 0.123, 0.138]
    gaps = trace.attribute(steps, [{"id": "a", "chunks": chunks}])
    assert [round(g["gap_ms"], 3) for g in gaps] == [11.0, 101.0, 15.0]
    slow = gaps[1]
    assert slow["step_ms"] == pytest.approx(100.0)
    assert slow["step_prompt_tokens"] == 300 and slow["step_prefills"] == 1 and slow["decode_rows"] == 1
    assert slow["between_ms"] == pytest.approx(1.0) and slow["lag_change_ms"] == pytest.approx(0.0)
    assert gaps[2]["lag_ms"] == pytest.approx(5.0) and gaps[2]["lag_change_ms"] == pytest.approx(4.0)
    report = trace._summarize(gaps, steps, [])
    assert report["top_count"] == 1 and report["top_with_prompt_in_step"] == 1
    a, b, c = report["fit_ms_base_per_prompt_token_per_decode_row"]
    assert b > 0  # the prompt chunk is what costs
    # b arrived at 0.020, waited for its first step (0.022), computed its prompt in two
    # steps (beside none of a's prompt) and its first token reached the client 2 ms late.
    (row,) = trace.attribute_ttft(steps, [{"id": "b", "prompt": 304, "send": 0.020, "chunks": [0.135]}])
    assert row["ttft_ms"] == pytest.approx(115.0) and row["wait_ms"] == pytest.approx(2.0)
    assert row["prefill_ms"] == pytest.approx(111.0) and row["delivery_ms"] == pytest.approx(2.0)
    assert row["prompt_steps"] == 2 and row["others_prompt_tokens"] == 0


def test_replay_emits_every_token_and_a_budget_shortens_the_slowest_gap():
    replay = _load("prefill_budget_replay")
    fit = (8.0, 0.2, 1.5)
    runs = {b: replay.replay(b, 512, 1.0, 0, 12, fit, 2048) for b in (0, 128)}
    from pagedserve.entrypoints.cli.bench_throughput import make_workload

    outputs = sum(n for _, n in make_workload(12, 0, 0, True, 0, 49152))
    for r in runs.values():
        assert len(r["ttft"]) == 12 and len(r["itl"]) == outputs - 12
    # No gap beside a 128-token budget can cost a 512-token chunk.
    assert max(runs[128]["itl"]) < max(runs[0]["itl"])
    assert max(runs[128]["itl"]) <= (8.0 + 0.2 * 128 + 1.5 * 12) / 1e3 + 1e-9
