"""`pagedserve simulate calibrate` (the full run is slow: one to two minutes)."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.simulate.calibrate import calibrate
from pagedserve.simulate.hardware import load_profile


def test_cpu_timer_needs_one_thread():
    with pytest.raises(ValueError, match="--threads 1"):
        calibrate(threads=2, timer="cpu")


@pytest.mark.slow
def test_calibrate_writes_a_usable_cpu_local(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert main(["simulate", "calibrate", "--threads", "1", "--timer", "cpu"]) == 0
    path = tmp_path / "simulate" / "cpu-local.json"
    data = json.loads(path.read_text())
    # the default model is Q4_1 GGUF: its own prepared linears and LM head were measured
    assert set(data["matmul_curve"]) == {"q4_1", "lm_head:q4_1"}
    ops = data["calibrated"]["q4_1"]["ops"]
    assert set(ops) >= {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all("gguf_linear" in what for what in ops.values()), ops
    profile = load_profile("cpu-local")
    assert profile.attention_bandwidth > 0 and profile.memory_bandwidth > 0
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "simulate",
                "--hardware",
                "cpu-local",
                "--num-prompts",
                "4",
                "--kv-cache-memory",
                "1GiB",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["simulated"]["tokens_per_s"] > 0
