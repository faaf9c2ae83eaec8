"""Workloads: the benchmarks' own prompts and arrivals, distributions, traces."""

from __future__ import annotations

import argparse
import json
import random
import statistics

import pytest

from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.cli.bench_throughput import make_workload
from pagedserve.simulate.workload import SHAREGPT, build_workload


def _args(*extra: str) -> argparse.Namespace:
    argv = ["simulate", "--hardware", "h100-sxm", *extra]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("mixed", [False, True])
def test_same_prompts_as_bench_throughput(mixed):
    extra = ["--num-prompts", "10", "--seed", "7"] + (["--mixed"] if mixed else [])
    work = build_workload(_args(*extra), 5000, 4096)
    ref = make_workload(10, 128, 128, mixed, 7, 5000)
    assert [(w.prompt_token_ids, w.output_len) for w in work] == ref
    assert all(w.arrival == 0.0 for w in work)


def test_poisson_arrivals_match_bench_serve():
    work = build_workload(_args("--num-prompts", "6", "--request-rate", "4", "--seed", "3"), 5000, 4096)
    rng = random.Random(3)  # bench serve: sleep expovariate(rate) after each send
    expected, t = [], 0.0
    for _ in range(6):
        expected.append(t)
        t += rng.expovariate(4.0)
    assert [w.arrival for w in work] == pytest.approx(expected)


def test_bursty_arrivals_keep_the_rate():
    work = build_workload(
        _args(
            "--num-prompts",
            "4000",
            "--request-rate",
            "10",
            "--burstiness",
            "0.25",
            "--input-len",
            "8",
            "--output-len",
            "2",
        ),
        5000,
        4096,
    )
    gaps = [b.arrival - a.arrival for a, b in zip(work, work[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) > 1.5 * statistics.fmean(gaps)  # gamma(0.25): cv = 2


def test_length_distributions():
    uni = build_workload(
        _args(
            "--num-prompts",
            "500",
            "--input-dist",
            "uniform",
            "--input-len",
            "100",
            "--output-dist",
            "lognormal",
            "--output-len",
            "200",
        ),
        5000,
        100000,
    )
    ins = [len(w.prompt_token_ids) for w in uni]
    assert min(ins) >= 50 and max(ins) <= 150
    assert statistics.fmean(w.output_len for w in uni) == pytest.approx(200, rel=0.15)
    sg = build_workload(_args("--workload", "sharegpt", "--num-prompts", "3000"), 5000, 100000)
    assert statistics.fmean(len(w.prompt_token_ids) for w in sg) == pytest.approx(SHAREGPT["input_mean"], rel=0.1)
    assert statistics.fmean(w.output_len for w in sg) == pytest.approx(SHAREGPT["output_mean"], rel=0.1)


def test_shared_prefixes_share_token_ids():
    work = build_workload(
        _args("--num-prompts", "6", "--input-dist", "uniform", "--shared-prefix-len", "40", "--num-prefixes", "2"),
        5000,
        4096,
    )
    assert work[0].prompt_token_ids[:40] == work[2].prompt_token_ids[:40] == work[4].prompt_token_ids[:40]
    assert work[0].prompt_token_ids[:40] != work[1].prompt_token_ids[:40]
    assert work[0].prompt_token_ids[40:50] != work[2].prompt_token_ids[40:50]


def test_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"arrival": 0.5, "prompt_len": 30, "output_len": 4, "prefix_id": "a", "prefix_len": 16},
        {"arrival": 0.1, "prompt_len": 20, "output_len": 5, "prefix_id": "a", "prefix_len": 16},
        {"arrival": 0.2, "prompt_len": 10, "output_len": 6},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    work = build_workload(_args("--workload", str(trace)), 5000, 4096)
    assert [w.arrival for w in work] == [0.1, 0.2, 0.5]
    assert [len(w.prompt_token_ids) for w in work] == [20, 10, 30]
    assert work[0].prompt_token_ids[:16] == work[2].prompt_token_ids[:16]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt_len": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        build_workload(_args("--workload", str(bad)), 5000, 4096)
