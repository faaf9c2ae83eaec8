"""benchmarks/run_facts.py: the facts each benchmark run records next to its speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

# Loaded by path: putting benchmarks/ on sys.path would let its scripts shadow packages.
_spec = importlib.util.spec_from_file_location(
    "bench_run_facts", Path(__file__).resolve().parents[2] / "benchmarks" / "run_facts.py"
)
run_facts = importlib.util.module_from_spec(_spec)
sys.modules["bench_run_facts"] = run_facts  # dataclasses look their module up
_spec.loader.exec_module(run_facts)
RunClock, engine_step_facts, process_facts = run_facts.RunClock, run_facts.engine_step_facts, run_facts.process_facts


def test_engine_step_facts_counts_steps_between_snapshots():
    before = SimpleNamespace(iteration_tokens_buckets=(1, 3, 5), iteration_tokens_sum=700, num_preemptions=1)
    after = SimpleNamespace(iteration_tokens_buckets=(1, 7, 12), iteration_tokens_sum=1400, num_preemptions=1)
    assert engine_step_facts(before, after) == {
        "steps": 7,
        "batched_tokens": 700,
        "mean_tokens_per_step": 100.0,
        "preemptions": 0,
    }
    empty = SimpleNamespace(iteration_tokens_buckets=(), iteration_tokens_sum=0, num_preemptions=0)
    assert engine_step_facts(empty, empty)["mean_tokens_per_step"] is None


def test_process_facts_and_clock():
    import torch

    facts = process_facts()
    assert facts["torch_threads"] == torch.get_num_threads()
    assert facts["os_threads"] >= 1
    if Path("/proc/self/maps").is_file():
        assert any("omp" in lib for lib in facts["openmp_runtimes"])  # torch's OpenMP runtime
    clock = RunClock()
    x = 0
    for i in range(200_000):
        x += i
    run = clock.stop()
    assert run["wall_s"] > 0 and run["cpu_s"] >= 0 and run["involuntary_switches"] >= 0
