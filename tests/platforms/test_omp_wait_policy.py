"""`import pagedserve` chooses a short OpenMP spin (GOMP_SPINCOUNT) before torch loads.

The OpenMP runtime reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch is first imported, so the
choice must come first; a policy (or GOMP_SPINCOUNT) the user set is kept, and so is
whatever the runtime already read when torch came first (docs/kernels_cpu.md, "Threads").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import {first}, os; import pagedserve; e = os.environ; "
    "print(e.get('OMP_WAIT_POLICY'), e.get('GOMP_SPINCOUNT'), pagedserve.OMP_WAIT_POLICY_SET)"
)


def _probe(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("first", "env", "expected"),
    [
        ("sys", {}, "None 3000 True"),
        ("sys", {"OMP_WAIT_POLICY": "active"}, "active None False"),
        ("sys", {"GOMP_SPINCOUNT": "300000"}, "None 300000 False"),
        ("torch", {}, "None None False"),  # too late: the runtime has read its settings
    ],
    ids=["default", "user-policy", "user-spincount", "torch-first"],
)
def test_wait_policy_default(first, env, expected):
    assert _probe(first, **env) == expected
