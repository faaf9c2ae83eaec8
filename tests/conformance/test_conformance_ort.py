"""examples/onnxruntime_platform: a separately pip-installed distribution, unknown to
pagedserve, adds the platform ``ort`` (dense layers on ONNX Runtime) and passes the
conformance kit; its greedy outputs match transformers."""

from __future__ import annotations

import gc
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: pip install 'onnxruntime>=1.17' 'onnx>=1.15'")
pytest.importorskip("onnx", reason="onnx is not installed: pip install 'onnxruntime>=1.17' 'onnx>=1.15'")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.testing import make_tiny_llama  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "onnxruntime_platform"


@pytest.fixture(scope="module")
def ort_site(tmp_path_factory) -> Path:
    """The example pip-installed (with its entry point) into a directory of its own."""
    # --no-build-isolation builds with this environment's setuptools (no network).
    pytest.importorskip("setuptools", minversion="77", reason="building pagedserve-ort offline needs setuptools>=77")
    tmp = tmp_path_factory.mktemp("ort")
    src = shutil.copytree(EXAMPLE, tmp / "src")  # setuptools leaves build/ next to the sources
    site = tmp / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "pagedserve_ort" / "linear.py").is_file()
    return site


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ort-model"), writer="safetensors")


@pytest.fixture
def ort_importable(ort_site, monkeypatch):
    """The installed example importable and discoverable in this process."""
    monkeypatch.syspath_prepend(str(ort_site))
    importlib.invalidate_caches()
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    yield
    for mod in [m for m in sys.modules if m == "pagedserve_ort" or m.startswith("pagedserve_ort.")]:
        del sys.modules[mod]
    importlib.invalidate_caches()


def subprocess_env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


def test_ort_passes_the_kit_under_pytest(ort_site, tiny_model, tmp_path):
    # Selected the way users select it: PAGEDSERVE_TARGET_DEVICE, no --platform.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "pagedserve.testing.pytest_plugin",
        "--pyargs",
        "pagedserve.testing.conformance",
        "--conformance-model",
        str(tiny_model),
        "-v",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(
        cmd,
        env=subprocess_env(ort_site, PAGEDSERVE_TARGET_DEVICE="ort"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    outcomes = dict(re.findall(r"test_conformance\[(.+?)\] (PASSED|FAILED|SKIPPED)", proc.stdout))
    assert outcomes and set(outcomes.values()) == {"PASSED"}, outcomes
    ops = {i.split("[")[0] for i in outcomes if i.startswith("op:")}
    assert ops == {"op:linear", "op:prepare_linear_weight"}  # the ops it overrides; float32 only
    # Six shapes on prepared weights, two on a weight rewritten in place (weight offload).
    assert sum(i.startswith("op:linear[float32-") for i in outcomes) == 8
    assert sum(i.startswith("op:linear[float32-streamed-weight") for i in outcomes) == 2
    assert outcomes["engine:greedy-vs-cpu-reference"] == "PASSED"
    assert "platform:kv-cache[float32-bs32]" in outcomes and "platform:kv-cache[bfloat16-bs16]" not in outcomes


def test_ort_check_from_the_command_line(ort_site, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "platforms", "check", "ort", "--skip-engine"],
        env=subprocess_env(ort_site),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "conformance of platform 'ort' (from pagedserve-ort 0.1.0)" in lines
    assert "  overridden ops: linear (pagedserve_ort), prepare_linear_weight (pagedserve_ort)" in lines
    assert any(line.startswith("PASS  op:linear[float32-2x3x64->48+bias]") for line in lines)
    assert re.fullmatch(r"PASSED: \d+ passed, 0 failed, 0 skipped in [\d.]+s", lines[-1]), lines[-1]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_ort_greedy_matches_transformers(ort_importable, tiny_llama):
    transformers = pytest.importorskip("transformers")
    from pagedserve import LLM, SamplingParams
    from pagedserve.testing.engine_check import conformance_prompts

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    prompts = conformance_prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p, 10) for p in prompts]

    llm = LLM(
        model=str(tiny_llama),
        device="ort",
        dtype="float32",
        kv_cache_memory="8MiB",
        max_num_batched_tokens=32,
        block_size=16,
    )
    engine = llm.llm_engine
    assert engine.platform.name == "ort" and engine.ops.source("linear") == "pagedserve_ort"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    # ONNX Runtime really ran: one session per dense weight (qkv, o, gate_up, down per
    # layer, and the output layer).
    cache = engine.ops.linear.__self__
    assert len(cache) == 4 * hf.config.num_hidden_layers + 1
    del llm, engine
    gc.collect()


def test_sessions_are_cached_per_weight(ort_importable):
    from pagedserve_ort.linear import OrtLinear

    lin = OrtLinear(["CPUExecutionProvider"], threads=1)
    x, w, b = torch.randn(5, 32), lin.prepare(torch.randn(16, 32)), torch.randn(16)
    for bias in (None, b, None):
        torch.testing.assert_close(lin.linear(x, w, bias), reference.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert len(lin) == 2  # (w) and (w, b)
    w.mul_(2)  # an in-place update must not be served from the stale session
    torch.testing.assert_close(lin.linear(x, w), reference.linear(x, w), atol=1e-5, rtol=1e-5)
    del w
    gc.collect()
    assert len(lin) == 0  # the sessions went with their weight
    # Outside what the graphs are built for, the reference answers.
    w16 = torch.randn(8, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(lin.linear(x.bfloat16(), w16), reference.linear(x.bfloat16(), w16))
    assert len(lin) == 0


def test_execution_providers_come_from_the_environment(ort_importable, monkeypatch):
    from pagedserve_ort import OrtPlatform

    assert OrtPlatform.providers() == ["CPUExecutionProvider"]
    monkeypatch.setenv("PAGEDSERVE_ORT_PROVIDERS", "NoSuchExecutionProvider, CPUExecutionProvider")
    assert OrtPlatform.providers() == ["NoSuchExecutionProvider", "CPUExecutionProvider"]
    ok, reason = OrtPlatform.is_available()
    assert not ok and "NoSuchExecutionProvider" in reason and "CPUExecutionProvider" in reason
    monkeypatch.setenv("PAGEDSERVE_ORT_PROVIDERS", "CPUExecutionProvider")
    assert OrtPlatform.is_available()[0]


def test_pagedserve_does_not_know_the_plugin():
    for pkg in ("core", "platforms", "kernels"):
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            assert "pagedserve_ort" not in path.read_text(encoding="utf-8"), path


def test_unprepared_weight_rewritten_in_place(ort_importable):
    """Weight offload's staging slots: plain inference tensors rewritten in place. They
    must never be served from a session built on their old contents."""
    from pagedserve_ort.linear import OrtLinear

    lin = OrtLinear(["CPUExecutionProvider"], threads=1)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        slot = torch.empty(16, 32)
        for _ in range(3):
            w = torch.randn(16, 32)
            slot.copy_(w)
            torch.testing.assert_close(lin.linear(x, slot), reference.linear(x, w), atol=1e-5, rtol=1e-5)
    assert len(lin) == 0


def test_ort_weight_offload_matches_no_offload(ort_importable, tmp_path):
    """Four layers all offloaded: two staging slots, each rewritten by two layers a step."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.testing import TinyLlamaSpec
    from pagedserve.testing.engine_check import conformance_prompts

    model = make_tiny_llama(tmp_path / "four", TinyLlamaSpec(num_hidden_layers=4), writer="safetensors")
    prompts = conformance_prompts(200)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for offload in (0, 1.0):
        llm = LLM(model=str(model), device="ort", dtype="float32", kv_cache_memory="8MiB", cpu_offload_gb=offload)
        streamer = llm.llm_engine.weight_streamer
        assert (streamer.offloaded == [0, 1, 2, 3]) if offload else streamer is None
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
        gc.collect()
    assert outs[0] == outs[1]
