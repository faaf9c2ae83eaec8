"""The conformance kit checks the quantized linear ops a platform registers: a correct
set passes, and a wrong one fails under the op's id, naming the op and its source --
including errors the activation-quantization allowance must not hide."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import quant_reference as qref
from pagedserve.kernels import reference
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.testing import ConformanceReport
from tests.conformance.fake_op_platform import check_ops, fake_platform

QUANT_OPS = ("gguf_linear", "int8_linear", "w8a8_linear", "fp8_linear")


QuantFakePlatform = fake_platform("qfake")


def faulty(fault: str | None) -> dict[str, object]:
    """The plugin's ops: the CPU platform's own (correct) unless ``fault`` breaks one."""

    def gguf_linear(x, data, type_name, bias=None):
        if fault == "gguf-drops-bias":
            bias = None
        if fault == "gguf-q4_1-without-minimum" and type_name == "Q4_1":
            blocks = data.reshape(data.shape[0], -1, 20).clone()
            blocks[..., 2:4] = 0  # the fp16 minimum m read as 0
            data = blocks.reshape(data.shape)
        return cpu_quant.gguf_linear(x, data, type_name, bias)

    def int8_linear(x, qweight, scale, bias=None):
        y = cpu_quant.int8_linear(x, qweight, scale, bias)
        if fault == "int8-last-channel":  # one output channel scaled wrongly
            y[:, -1] *= 1.5
        return y

    def fp8_linear(x, qweight, scale, bias=None):
        if fault == "fp8-per-tensor-scale-ignored" and scale.dim() == 0:
            scale = torch.ones_like(scale)
        return qref.fp8_linear_dense(x, qweight, scale, bias)

    return {
        "gguf_linear": gguf_linear,
        "int8_linear": int8_linear,
        "w8a8_linear": cpu_quant.w8a8_linear,
        "fp8_linear": fp8_linear,
    }


def check(fault: str | None, only: list[str] | None = None) -> ConformanceReport:
    return check_ops(QuantFakePlatform, faulty(fault), only=only or ["op:"])


@pytest.fixture(scope="module")
def healthy() -> ConformanceReport:
    return check(None)


def test_correct_quantized_ops_pass_in_every_dtype(healthy):
    assert healthy.ok, healthy.format(verbose=False)
    assert set(healthy.overridden_ops) == set(QUANT_OPS)
    ids = {r.id for r in healthy.results}
    for expected in (
        "op:gguf_linear[float32-Q4_1-7x128->40+bias]",
        "op:gguf_linear[bfloat16-Q8_0-130x64->24+bias]",
        "op:int8_linear[bfloat16-33x128->64+bias]",
        "op:w8a8_linear[float32-1x64->48]",
        "op:fp8_linear[bfloat16-tensor-7x128->32+bias]",
    ):
        assert expected in ids
    assert {i.split("[")[0] for i in ids} == {f"op:{op}" for op in QUANT_OPS}


@pytest.mark.parametrize(
    ("fault", "failing"),
    [
        (
            "gguf-drops-bias",
            {"op:gguf_linear[float32-Q4_0-7x128->40+bias]", "op:gguf_linear[bfloat16-Q8_0-130x64->24+bias]"},
        ),
        (
            "gguf-q4_1-without-minimum",
            {"op:gguf_linear[float32-Q4_1-1x64->48]", "op:gguf_linear[bfloat16-Q4_1-130x64->24+bias]"},
        ),
        ("int8-last-channel", {"op:int8_linear[float32-1x64->48]", "op:int8_linear[bfloat16-33x128->64+bias]"}),
        ("fp8-per-tensor-scale-ignored", {"op:fp8_linear[float32-tensor-7x128->32+bias]"}),
    ],
)
def test_a_wrong_quantized_op_fails_under_its_name(healthy, fault, failing):
    report = check(fault)
    assert not report.ok
    failed = {r.id for r in report.failed}
    assert failing <= failed, sorted(failed)
    op = next(iter(failing)).split("[")[0].removeprefix("op:")
    assert all(i.startswith(f"op:{op}[") for i in failed), sorted(failed)
    assert all(r.message.startswith(f"op {op} (from qfake-kernels): {op}: ") for r in report.failed)
    assert report.count("passed") == healthy.count("passed") - len(failed)


def wrong_dtype_gguf_linear(x, data, type_name, bias=None):
    return reference.gguf_linear(x, data, type_name, bias).float()


def test_an_op_returning_another_dtype_fails():
    report = check_ops(QuantFakePlatform, {"gguf_linear": wrong_dtype_gguf_linear}, only=["op:gguf_linear"])
    # float32 outputs are right; bfloat16 inputs must come back as bfloat16.
    assert report.failed and {r.id.split("-")[0] for r in report.failed} == {"op:gguf_linear[bfloat16"}
    assert all("dtype float32, reference bfloat16" in r.message for r in report.failed)
