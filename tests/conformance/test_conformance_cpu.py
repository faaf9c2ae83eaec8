"""The builtin cpu platform passes the conformance kit, run the way a plugin author runs
it: ``pytest --pyargs pagedserve.testing.conformance --platform cpu`` in a fresh
interpreter (native kernels on, as users get them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.testing import make_tiny_llama, select_target


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # pagedserve's own writer: the subprocess then never imports transformers.
    return make_tiny_llama(tmp_path_factory.mktemp("conformance-model"), writer="safetensors")


def kit_env() -> dict[str, str]:
    """This environment without platform selection, so ``--platform`` alone decides."""
    return {
        k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_TARGET_DEVICE", "PAGEDSERVE_PLUGINS", "PYTHONPATH")
    }


def run_kit(*args: str, env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run the kit under pytest; returns the process and {check id: PASSED/FAILED/SKIPPED}."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "pagedserve.testing.pytest_plugin",
        "--pyargs",
        "pagedserve.testing.conformance",
        "-v",
        "-p",
        "no:cacheprovider",
        *args,
    ]
    # Generous: the first use of the native CPU kernels on a machine compiles them.
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    outcomes = dict(re.findall(r"test_conformance\[(.+?)\] (PASSED|FAILED|SKIPPED)", proc.stdout))
    return proc, outcomes


def test_cpu_passes_the_kit(tiny_model, tmp_path):
    proc, outcomes = run_kit("--platform", "cpu", "--conformance-model", str(tiny_model), env=kit_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert outcomes and set(outcomes.values()) == {"PASSED"}, outcomes
    for check in (
        "platform:memory",
        "platform:kv-cache[float32-bs16]",
        "platform:kv-cache[float32-bs32]",
        "platform:copy-async[float32]",
        "engine:greedy-vs-cpu-reference",
    ):
        assert outcomes.get(check) == "PASSED", check
    # Exactly the ops the cpu platform overrides here (its native kernels, where they
    # built) were compared with the reference, each in every dtype the platform supports.
    target = select_target("cpu", env=kit_env())
    op_ids = [i for i in outcomes if i.startswith("op:")]
    assert {i.split("[")[0].removeprefix("op:") for i in op_ids} == set(target.overridden_ops())
    for op in target.overridden_ops():
        for dtype in target.dtypes():
            name = str(dtype).removeprefix("torch.")
            assert any(i.startswith(f"op:{op}[{name}-") for i in op_ids), (op, name)
