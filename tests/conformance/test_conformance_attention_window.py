"""The conformance kit's paged_attention cases (windows shorter than the prompt, prefill
chunks, decodes, mixed batches, GQA, soft-cap with and without a window, head sizes
64-128, slid-out table entries pointing at a NaN block, attention sinks with and
without a window, spans attending both ways with and without a window) run against three
implementations on the CPU platform's caches: its own op (the native kernel), the torch
reference itself, and the Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.testing.attention_window_cases import SINK_CASES, SPAN_CASES, WINDOW_CASES
from pagedserve.testing.op_checks import OP_CASES
from pagedserve.testing.target import select_target

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_target():
    return select_target("cpu")


def _run_cases(target, fn, dtype: torch.dtype, windowed_only: bool) -> list[str]:
    ran = []
    for desc, body in OP_CASES["paged_attention"](target, fn, dtype, 0):
        if windowed_only and not any(k in desc for k in ("sliding_window", "soft_cap", "sinks")):
            continue
        body()
        ran.append(desc)
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_platform_op_passes_every_case(cpu_target, dtype):
    ran = _run_cases(cpu_target, cpu_target.ops.get("paged_attention"), dtype, windowed_only=False)
    cases = WINDOW_CASES + SINK_CASES + SPAN_CASES[1:]  # the span cases after the first run long
    assert sum("slidout-nan" in d for d in ran) == sum("sliding_window" in e for *_, e in cases)
    assert sum("sinks" in d for d in ran) == len(SINK_CASES)
    assert sum("key_ends" in d for d in ran) == len(SPAN_CASES)
    assert len(ran) >= 7 + 4 + len(cases) + 1


def test_reference_passes_the_windowed_cases(cpu_target):
    """The reference against itself on the original tables: it must not read the NaN block."""
    _run_cases(cpu_target, reference.paged_attention, torch.float32, windowed_only=True)


_TRITON_SCRIPT = """
import torch
from pagedserve.kernels.triton import attention
from pagedserve.testing.op_checks import OP_CASES
from pagedserve.testing.target import select_target

target = select_target("cpu")
n = 0
for dtype in (torch.float32, torch.float16):
    for desc, body in OP_CASES["paged_attention"](target, attention.paged_attention, dtype, 0):
        if "sliding_window" in desc or "soft_cap" in desc or "sinks" in desc:
            body()
            n += 1
print("cases", n)
"""


def test_triton_interpreter_passes_the_windowed_cases():
    """In a subprocess: TRITON_INTERPRET must be set before triton is imported."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT
    )
    assert res.returncode == 0, res.stderr[-4000:]
    spans = sum("sliding_window" in e or "soft_cap" in e for *_, e in SPAN_CASES)
    assert f"cases {2 * (4 + len(WINDOW_CASES) + len(SINK_CASES) + spans)}" in res.stdout
