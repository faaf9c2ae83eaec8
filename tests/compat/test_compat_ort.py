"""The matrix's out-of-tree platform column (docs/compatibility.md): the ONNX Runtime
plugin of examples/onnxruntime_platform, pip-installed into a folder of its own and found
through its entry point, serves each feature's cells with the single process's results on
the built-in platform (tests/compat/compat_cases.py).  The plugin supplies only the dense
``linear`` op: quantized weights, LoRA and the rest run the ops pagedserve falls back to
on a plugin platform, and must give the same results there."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compat_cases import CASES, cell_params, check_cell

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: pip install 'onnxruntime>=1.17' 'onnx>=1.15'")
pytest.importorskip("onnx", reason="onnx is not installed: pip install 'onnxruntime>=1.17' 'onnx>=1.15'")

pytestmark = pytest.mark.timeout(600)

COMPAT_FEATURES = (
    "prefix_caching",
    "chunked_prefill",
    "preemption_recompute",
    "n_best_of",
    "beam_search",
    "structured_outputs",
    "logits_processors",
    "prompt_logprobs",
    "priority",
    "pooling",
    "preemption_swap",
    "spec_ngram",
    "spec_draft_model",
    "spec_self_quantized",
    "lora",
    "quant_gguf",
    "quant_int8",
    "quant_fp8",
    "quant_gptq_awq",
    "kv_groups",
    "sleep_mode",
    "kv_connector",
)
COMPAT_DEPLOYMENTS = ("plugin_ort",)
assert set(CASES) >= set(COMPAT_FEATURES)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "onnxruntime_platform"


@pytest.fixture(scope="module", autouse=True)
def ort_plugin(tmp_path_factory):
    """The example installed (with its entry point) and importable in this process."""
    pytest.importorskip("setuptools", minversion="77", reason="building pagedserve-ort offline needs setuptools>=77")
    tmp = tmp_path_factory.mktemp("ort")
    src = shutil.copytree(EXAMPLE, tmp / "src")
    site = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "-q", "--target", str(site), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        importlib.invalidate_caches()
        yield
    for mod in [m for m in sys.modules if m == "pagedserve_ort" or m.startswith("pagedserve_ort.")]:
        del sys.modules[mod]
    importlib.invalidate_caches()


@pytest.mark.parametrize(("feature", "deployment"), cell_params(COMPAT_FEATURES, COMPAT_DEPLOYMENTS))
def test_cell_matches_one_process(engines, feature, deployment):
    check_cell(engines, feature, deployment)
