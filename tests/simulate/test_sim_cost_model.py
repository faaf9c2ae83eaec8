"""The step cost model against hand-computed rooflines, and hardware profiles."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import LLAMA3_8B, LLAMA3_70B, MIXTRAL

from pagedserve.simulate.calibrate import _fit_overhead
from pagedserve.simulate.cost_model import CostModel, StepBatch
from pagedserve.simulate.hardware import HardwareProfile, load_profile, shipped_profiles
from pagedserve.simulate.model_spec import ModelSpec, load_model_config


def test_shipped_profiles_load():
    names = shipped_profiles()
    assert {"h100-sxm", "h200-sxm", "a100-sxm", "mi300x", "cpu-generic"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.sources and p.memory_bytes > 0 and p.peak("bfloat16") > 0
    assert load_profile("h200-sxm").memory_bandwidth == 4.8e12


def test_bad_profile_rejected(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {"name": "x", "memory_bytes": 1, "memory_bandwidth": 1, "peak_flops": {"bfloat16": 1}, "efficency": {}}
        )
    )
    with pytest.raises(ValueError, match="unknown keys"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="efficiency"):
        HardwareProfile("x", 1, 1, {"bfloat16": 1}, efficiency={"matmul": 1.5})


def test_matmul_curve_interpolates_in_log_tokens():
    p = HardwareProfile("x", 1, 1, {"bfloat16": 1}, matmul_curve={"bfloat16": [[1, 10], [100, 30]]})
    assert p.matmul_rate("bfloat16", "bfloat16", 10) == pytest.approx(20)
    assert p.matmul_rate("bfloat16", "bfloat16", 0.5) == 10 and p.matmul_rate("bfloat16", "bfloat16", 1e6) == 30


def test_decode_is_weight_bandwidth_bound():
    hw = load_profile("h100-sxm")
    cost = CostModel(ModelSpec.from_config(LLAMA3_70B), hw, tensor_parallel_size=4)
    parts = cost.breakdown(StepBatch([1], [100], 1))
    layer_bytes = 80 * (8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672) * 2
    assert parts["linear"] == pytest.approx(layer_bytes / 4 / (3.35e12 * 0.8))
    assert parts["tp_comm"] == pytest.approx(2 * 80 * (8e-6 + 2 * 3 / 4 * 8192 * 2 / (450e9 * 0.7)))


def test_prefill_is_compute_bound_and_fp8_doubles_the_rate():
    hw = load_profile("h100-sxm")
    spec = ModelSpec.from_config(LLAMA3_8B)
    batch = StepBatch([8192], [8192], 1)
    bf16 = CostModel(spec, hw).breakdown(batch)
    active = spec.layer_params_active
    assert bf16["linear"] == pytest.approx(2 * 8192 * active / (989.5e12 * 0.7))
    fp8 = CostModel(spec.with_format("fp8"), hw).breakdown(batch)
    assert fp8["linear"] == pytest.approx(bf16["linear"] / 2)


def test_attention_follows_the_context_lengths():
    cost = CostModel(ModelSpec.from_config(LLAMA3_8B), load_profile("h100-sxm"))
    short = cost.breakdown(StepBatch([1] * 64, [128] * 64, 64))["attention"]
    long = cost.breakdown(StepBatch([1] * 64, [4096] * 64, 64))["attention"]
    assert long / short == pytest.approx(4096 / 128, rel=0.05)  # K/V bytes read dominate
    kv_bytes = 64 * 4096 * ModelSpec.from_config(LLAMA3_8B).kv_bytes_per_token(2)
    assert long == pytest.approx(kv_bytes / (3.35e12 * 0.6), rel=0.02)


def test_moe_reads_only_the_experts_it_routes_to():
    spec = ModelSpec.from_config(MIXTRAL)
    cost = CostModel(spec, load_profile("h100-sxm"), tensor_parallel_size=2)
    one = cost.breakdown(StepBatch([1], [10], 1))["linear"]
    many = cost.breakdown(StepBatch([1] * 256, [10] * 256, 256))["linear"]
    assert one < 0.5 * many  # 2 of 8 experts touched vs all of them


def test_host_copies_and_tp_requirements():
    spec = ModelSpec.from_config(LLAMA3_8B)
    cost = CostModel(spec, load_profile("h100-sxm"))
    parts = cost.breakdown(StepBatch([1], [10], 1, blocks_in=10))
    assert parts["kv_copies"] == pytest.approx(10 * cost.kv_bytes_per_block() / (64e9 * 0.8))
    no_link = HardwareProfile("x", 1e9, 1e9, {"bfloat16": 1e12})
    with pytest.raises(ValueError, match="interconnect"):
        CostModel(spec, no_link, tensor_parallel_size=2)


def test_calibration_fit_recovers_known_efficiency_and_overheads():
    """Steps priced by a known profile are fitted back to that profile's parameters."""
    truth = HardwareProfile(
        "t",
        1e10,
        2e10,
        {"bfloat16": 4e11},
        matmul_curve={"q4_1": [[1, 2e10], [64, 8e10], [2048, 2e11]]},
        efficiency={"matmul": 0.6},
        step_overhead_s=0.004,
        per_seq_overhead_s=0.0005,
        per_token_overhead_s=2e-4,
    )
    cost = CostModel(ModelSpec.from_config(load_model_config(None)), truth)
    batches = (
        [StepBatch([1], [40], 1)] * 3
        + [StepBatch([1] * 16, [40] * 16, 16)] * 3
        + [StepBatch([1] * 32, [40] * 32, 32)] * 3
        + [StepBatch([128], [128], 1), StepBatch([512], [512], 1), StepBatch([2048], [2048], 1)]
    )
    samples = [(b, cost.step_seconds(b)) for b in batches]
    fitted = copy.deepcopy(truth)
    fitted.efficiency = {"matmul": 1.0}
    fitted.step_overhead_s = fitted.per_seq_overhead_s = fitted.per_token_overhead_s = 0.0
    _fit_overhead(fitted, samples)
    assert fitted.eff("matmul") == pytest.approx(0.6, rel=0.02)
    assert fitted.step_overhead_s == pytest.approx(0.004, rel=0.05)
    assert fitted.per_seq_overhead_s == pytest.approx(0.0005, rel=0.05)
    assert fitted.per_token_overhead_s == pytest.approx(2e-4, rel=0.05)
