"""A calibrated profile prices each weight format with what was measured for it."""

from __future__ import annotations

import json
import warnings

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.simulate.calibrate import merge_calibrations
from pagedserve.simulate.cost_model import CostModel, StepBatch
from pagedserve.simulate.hardware import HardwareProfile, load_profile
from pagedserve.simulate.model_spec import ModelSpec, load_model_config

# Two formats measured on one machine: q4_1 (GGUF) 4x faster than bf16 at every row count.
Q4_CURVE = [[1, 4e9], [64, 8e10], [2048, 1.6e11]]
BF16_CURVE = [[1, 1e9], [64, 2e10], [2048, 4e10]]


def _entry(eff: float, step: float, model: str, machine: str = "cpu X; cpu; 2 threads; wall time") -> dict:
    return {
        "model": model,
        "machine": machine,
        "ops": {"qkv": "op under test"},
        "efficiency_matmul": eff,
        "step_overhead_s": step,
        "per_seq_overhead_s": 1e-5,
        "per_token_overhead_s": 2e-6,
    }


def _two_formats(**overrides) -> dict:
    data = {
        "name": "cpu-test",
        "memory_bytes": 16e9,
        "memory_bandwidth": 20e9,
        "peak_flops": {"bfloat16": 1.6e11},
        "efficiency": {"matmul": 1.0},
        "matmul_curve": {"q4_1": Q4_CURVE, "lm_head:q4_1": [[1, 2e9], [256, 2e10]], "bfloat16": BF16_CURVE},
        "calibrated": {"q4_1": _entry(0.8, 0.003, "gguf"), "bfloat16": _entry(0.5, 0.007, "bf16-folder")},
    }
    data.update(overrides)
    return data


def test_each_format_gets_its_own_curve_and_fit():
    hw = HardwareProfile.from_dict(_two_formats())
    q4, bf16 = hw.for_format("q4_1"), hw.for_format("bfloat16")
    assert (q4.eff("matmul"), q4.step_overhead_s) == (0.8, 0.003)
    assert (bf16.eff("matmul"), bf16.step_overhead_s) == (0.5, 0.007)
    assert set(q4.matmul_curve) == {"q4_1", "lm_head:q4_1"} and set(bf16.matmul_curve) == {"bfloat16"}
    assert q4.matmul_rate("q4_1", "bfloat16", 64) == pytest.approx(8e10 * 0.8)
    assert bf16.matmul_rate("bfloat16", "bfloat16", 64) == pytest.approx(2e10 * 0.5)
    assert hw.eff("matmul") == 1.0  # the profile itself is left as it was


def test_cost_model_uses_the_models_format():
    hw = HardwareProfile.from_dict(_two_formats())
    spec = ModelSpec.from_config(load_model_config(None))  # the default model: q4_1
    assert spec.weight_format == "q4_1"
    prefill = StepBatch([2048], [2048], 1)
    q4 = CostModel(spec, hw.for_format("q4_1")).breakdown(prefill)
    bf16 = CostModel(spec.with_format("bfloat16"), hw.for_format("bfloat16")).breakdown(prefill)
    flops = 2.0 * 2048 * spec.layer_params_active
    assert q4["linear"] == pytest.approx(flops / (1.6e11 * 0.8))
    assert bf16["linear"] == pytest.approx(flops / (4e10 * 0.5))
    # one sampled row: the LM head has its own curve for q4_1 (2e9 FLOP/s), the layers' for bf16 (1e9)
    assert q4["lm_head"] == pytest.approx(2.0 * spec.embedding_params / (2e9 * 0.8))
    assert bf16["lm_head"] == pytest.approx(2.0 * spec.embedding_params / (1e9 * 0.5))


def test_a_format_the_calibration_lacks_is_an_error():
    data = _two_formats()
    del data["calibrated"]["bfloat16"], data["matmul_curve"]["bfloat16"]
    hw = HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match=r"calibrated for q4_1 \(model gguf\), not for bfloat16") as e:
        hw.for_format("bfloat16")
    assert "pagedserve simulate calibrate --model" in str(e.value)


def test_cli_refuses_an_uncalibrated_format(tmp_path, capsys):
    data = _two_formats()
    del data["calibrated"]["bfloat16"], data["matmul_curve"]["bfloat16"]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    base = ["simulate", "--hardware", str(path), "--num-prompts", "4", "--kv-cache-memory", "1GiB"]
    assert main(base + ["--quantization", "none"]) == 2  # the default model as bf16
    assert "not for bfloat16 weights" in capsys.readouterr().err
    assert main(base) == 0  # its own q4_1
    assert '"weight_format": "q4_1"' in capsys.readouterr().out


def test_faster_format_curve_predicts_more_throughput(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_two_formats()))
    rates = {}
    for quant in ("auto", "none"):
        argv = ["simulate", "--hardware", str(path), "--num-prompts", "8", "--kv-cache-memory", "1GiB"]
        assert main(argv + ["--quantization", quant, "--json-out", str(tmp_path / "r.json")]) == 0
        rates[quant] = json.loads((tmp_path / "r.json").read_text())["simulated"]["tokens_per_s"]
    capsys.readouterr()
    assert rates["auto"] > 1.5 * rates["none"]


def test_shipped_and_legacy_profiles():
    h100 = load_profile("h100-sxm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert h100.for_format("bfloat16") is h100  # datasheet profile: no calibration to pick from
    legacy = HardwareProfile.from_dict({k: v for k, v in _two_formats().items() if k != "calibrated"})
    with pytest.warns(UserWarning, match="predates per-format calibration"):
        assert legacy.for_format("q4_1") is legacy
    with pytest.warns(UserWarning, match="no matmul curve for int8"):
        legacy.for_format("int8")


def test_calibrated_entry_needs_its_curve_and_fit():
    data = _two_formats()
    del data["matmul_curve"]["bfloat16"]
    with pytest.raises(ValueError, match=r"calibrated\['bfloat16'\] needs a matmul_curve"):
        HardwareProfile.from_dict(data)
    data = _two_formats()
    del data["calibrated"]["q4_1"]["step_overhead_s"]
    with pytest.raises(ValueError, match="missing: step_overhead_s"):
        HardwareProfile.from_dict(data)


def test_merge_keeps_other_formats_of_the_same_machine_only():
    old = HardwareProfile.from_dict(_two_formats())
    new_data = _two_formats()
    new_data["calibrated"] = {"q4_1": _entry(0.9, 0.002, "gguf-again")}
    new_data["matmul_curve"] = {"q4_1": Q4_CURVE}
    merged = merge_calibrations(old, HardwareProfile.from_dict(new_data), log=lambda *_: None)
    assert merged.calibrated["q4_1"]["model"] == "gguf-again"  # the new measurement wins
    assert merged.calibrated["bfloat16"]["model"] == "bf16-folder"  # kept
    assert merged.matmul_curve["bfloat16"] == [[float(a), float(b)] for a, b in BF16_CURVE]
    assert "lm_head:q4_1" not in merged.matmul_curve  # not re-measured, and q4_1 is new's
    other = _two_formats()
    for e in other["calibrated"].values():
        e["machine"] = "another CPU; cpu; 2 threads; wall time"
    merged = merge_calibrations(
        HardwareProfile.from_dict(other), HardwareProfile.from_dict(new_data), log=lambda *_: None
    )
    assert set(merged.calibrated) == {"q4_1"}


def test_the_platforms_prompt_chunk_cap_is_simulated(tmp_path):
    """A calibrated CPU profile carries the platform's 512-token prompt chunks: one 2048-token
    prompt takes four steps, as in the engine, instead of one."""
    from pagedserve.config import CacheConfig, SchedulerConfig
    from pagedserve.simulate.simulator import Simulator
    from pagedserve.simulate.workload import SimRequest

    spec = ModelSpec.from_config(load_model_config(None))
    steps = {}
    for cap in (0, 512):
        hw = HardwareProfile.from_dict(_two_formats(long_prefill_token_threshold=cap)).for_format("q4_1")
        sim = Simulator(CostModel(spec, hw), CacheConfig(), SchedulerConfig(), 1024, 4096)
        result = sim.run([SimRequest(0.0, list(range(100, 2148)), 1)])
        steps[cap] = result.num_steps
    assert steps == {0: 1, 512: 4}
