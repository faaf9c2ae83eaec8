"""pagedserve run from its source checkout: the repository root heads sys.path there
(``python -m pagedserve ...``, ``python -m pytest``), and the source folder kernels/ must not
stand in for the Hugging Face ``kernels`` package that transformers imports."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_in_root(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_transformers_loads_its_activations_from_the_checkout_root():
    # transformers.activations imports its hub-kernel integration (and with it `kernels`
    # where that package is installed): image processors and models all go through it.
    assert _run_in_root("import pagedserve, transformers.activations; print('ok')") == "ok"


def test_kernels_is_not_the_source_folder():
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hugging Face kernels package is not installed: nothing to shadow")
    origin = _run_in_root(
        "import sys, pagedserve, importlib.util; assert sys.path[0] == ''; "
        "print(importlib.util.find_spec('kernels').origin)"
    )
    assert Path(origin).resolve() != (ROOT / "kernels" / "__init__.py").resolve()
    # pagedserve's own kernels are unaffected.
    assert _run_in_root("import pagedserve.kernels as k; print(k.__name__)") == "pagedserve.kernels"
