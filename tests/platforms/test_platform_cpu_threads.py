"""Thread settings of the CPU platform: --threads and --cpu-bind (one core per thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pagedserve.config import DeviceConfig, parse_cpu_list

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    for bad in ("", "a", "3-1", "0,0", "1-", "-2"):
        with pytest.raises(ValueError, match="cpu_bind"):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="lists 2 cores"):
        DeviceConfig(threads=3, cpu_bind="0-1")


def _run(code: str) -> subprocess.CompletedProcess:
    # A fresh process: binding changes the affinity of the whole process.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two usable cores")
def test_each_thread_is_pinned_to_its_core():
    a, b = ALLOWED[-2], ALLOWED[-1]
    proc = _run(f"""
        import os, torch
        from pagedserve.platforms import select_platform
        from pagedserve.kernels.cpu import load_cpu_kernels
        platform, ops = select_platform("cpu")
        platform.configure_threads(None, [{b}, {a}])
        print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
        print(load_cpu_kernels().module.thread_cpus())
    """)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.split("\n")[:2]
    # Two threads; the calling thread (thread 0) now runs only on the first core listed.
    assert first == f"2 [{b}]"
    assert second == f"[{b}, {a}]"


def test_cores_outside_the_allowed_set_are_refused():
    bad = max(ALLOWED, default=0) + 1000
    proc = _run(f"""
        from pagedserve.platforms import select_platform
        platform, ops = select_platform("cpu")
        try:
            platform.configure_threads(None, [{bad}])
        except ValueError as e:
            print("refused:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"refused: cpu_bind names cores [{bad}]" in proc.stdout


def test_cli_refuses_bind_with_data_parallel_replicas():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--cpu-bind", "0", "--data-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "--cpu-bind with --data-parallel-size" in proc.stderr
