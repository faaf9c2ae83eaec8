"""`pagedserve simulate` end to end: --json-out keys, sweep, plot, errors, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.entrypoints.cli import main


def test_json_out_keys(tmp_path, profile_file, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "simulate",
            "--hardware",
            str(profile_file()),
            "--num-prompts",
            "8",
            "--input-len",
            "64",
            "--output-len",
            "16",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    sim = data["simulated"]
    for key in (
        "tokens_per_s",
        "generated_tokens",
        "elapsed_s",
        "peak_kv_usage",
        "num_preemptions",
        "preemptions",
        "prefix_cache_hit_rate",
        "request_throughput",
        "output_tokens_per_s",
    ):
        assert key in sim, key
    for dist in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(sim[dist]) >= {"mean", "p50", "p99"}
        assert 0 < sim[dist]["p50"] <= sim[dist]["p99"]
    assert sim["generated_tokens"] == 8 * 16
    assert sim["tokens_per_s"] == pytest.approx(sim["generated_tokens"] / sim["elapsed_s"])
    assert data["config"]["num_kv_blocks"] > 0
    timeline = sim["kv_usage_timeline"]
    assert 0 < len(timeline) <= 201 and timeline[-1][0] == pytest.approx(sim["elapsed_s"], abs=1e-5)
    assert max(u for _, u, _, _ in timeline) == pytest.approx(sim["peak_kv_usage"], abs=0.02)
    text = capsys.readouterr().out
    assert "TTFT" in text and "RESULT " in text


def test_sweep_finds_highest_rate_meeting_slo(tmp_path, profile_file):
    out = tmp_path / "sweep.json"
    hw = str(profile_file())
    rc = main(
        [
            "simulate",
            "--hardware",
            hw,
            "--num-prompts",
            "40",
            "--input-len",
            "256",
            "--output-len",
            "32",
            "--sweep",
            "rate=1:200",
            "--slo",
            "ttft_p99=0.3",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    sweep = json.loads(out.read_text())["sweep"]
    best = sweep["best_rate"]
    assert best is not None and 1 <= best < 200
    probes = sweep["probes"]
    assert all(p["ttft_p99"] <= 0.3 for p in probes if p["meets_slo"])
    assert any(not p["meets_slo"] and p["rate"] > best for p in probes)


def test_plot_written(tmp_path, profile_file):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["simulate", "--hardware", str(profile_file()), "--num-prompts", "6", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hardware", "no-such-gpu"], "neither a profile file nor a known profile"),
        ([], "--hardware is required"),
        (["--hardware", "h100-sxm", "--sweep", "rate=1:8"], "--sweep needs --slo"),
        (["--hardware", "h100-sxm", "--slo", "ttft=1"], "--slo"),
        (["--hardware", "h100-sxm", "--sweep", "qps=1:8", "--slo", "ttft_p99=1"], "--sweep"),
        (["--hardware", "h100-sxm", "--model", "/nonexistent/config.json"], "no config.json"),
        (["--hardware", "h100-sxm", "--workload", "/nonexistent.jsonl"], "JSONL trace"),
        (["--hardware", "h100-sxm", "--tensor-parallel-size", "4"], "does not divide"),
        (["--hardware", "h100-sxm", "--quantization", "nf4"], "--quantization"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cpu_local_missing_is_explained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert main(["simulate", "--hardware", "cpu-local"]) == 2
    assert "pagedserve simulate calibrate" in capsys.readouterr().err


def test_simulation_never_imports_torch(tmp_path):
    code = (
        "import sys; from pagedserve.entrypoints.cli import main; "
        "rc = main(['simulate', '--hardware', 'h200-sxm', '--num-prompts', '4', '--mixed']); "
        "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
