"""GGUF linears dispatched by measurement (platforms/cpu/tuned_gguf.py): with fake kernels
of known speed the fastest wins each bucket and the step runs it; small weights and
other types keep the static op; on a CPU with AMX the registered ops run what their plan
chose, within the reference's tolerance; tuning off keeps the VNNI kernel everywhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu import quant_gguf_amx
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.platforms.cpu.tuned_gguf import AMX_BF16_MIN_ROWS, TunedGguf
from pagedserve.platforms.cpu.tuning import Tuner
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import CpuOptions

BUCKETS = (1, 4, 16, 64, 256)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_module(clock: FakeClock, name: str, cost, calls: list):
    """A kernel module whose linears advance ``clock`` by cost(rows) and say who ran."""

    def linear(x, packed, type_id, bias):
        clock.now += cost(x.shape[0])
        calls.append((name, x.shape[0]))
        return torch.full((x.shape[0], packed.shape[0] * 16), float(len(name)))

    return SimpleNamespace(
        gguf_linear_out=linear,
        gguf_linear_silu_out=linear,
        gguf_bf16_linear_out=linear,
        gguf_bf16_linear_silu_out=linear,
        has_packed_gated=lambda: True,
    )


def _fake_packed(n: int, k: int) -> torch.Tensor:
    return torch.zeros(n // 16, k // 32, 16 * ref.GGUF_BLOCK_BYTES["Q4_1"], dtype=torch.uint8)


def test_fastest_fake_kernel_wins_each_bucket_and_runs():
    clock, calls = FakeClock(), []
    # VNNI: linear in rows from a small start; AMX-BF16: a fixed dequantization cost.
    vnni = _fake_module(clock, "vnni", lambda m: 1.0 + 1.0 * m, calls)
    amx = _fake_module(clock, "amx", lambda m: 40.0 + 0.1 * m, calls)
    statics = []
    tuned = TunedGguf(
        Tuner(None, clock=clock, threads=1),
        vnni,
        amx,
        prepare=lambda data, t: data,
        linear=lambda *a: statics.append("linear"),
        gated=lambda *a: statics.append("gated"),
        buckets=BUCKETS,
    )
    packed = tuned.prepare(_fake_packed(512, 256), "Q4_1")
    plan = next(iter(tuned.tuner.plans.values()))
    assert plan.chosen == {1: "vnni", 4: "vnni", 16: "vnni", 64: "amx_bf16", 256: "amx_bf16"}
    # Below AMX_BF16_MIN_ROWS the AMX candidate is never timed.
    assert all("amx_bf16" not in plan.times[b] for b in BUCKETS if b < AMX_BF16_MIN_ROWS)
    for rows, who in ((1, "vnni"), (16, "vnni"), (17, "amx"), (300, "amx")):
        calls.clear()
        tuned.gguf_linear(torch.randn(rows, 256), packed, "Q4_1")
        assert calls == [(who, rows)]
        calls.clear()
        tuned.gguf_linear_silu_and_mul(torch.randn(rows, 256), packed, "Q4_1")
        assert calls[-1] == (who, rows)  # after the gated plan's timing at the first call
    assert {p.op for p in tuned.tuner.plans.values()} == {"gguf_linear", "gguf_linear_silu_and_mul"}
    assert not statics
    # Another type name than the route's, a 3-D x, or an unrouted weight: the static op.
    tuned.gguf_linear(torch.randn(4, 256), packed, "Q4_0")
    tuned.gguf_linear(torch.randn(4, 256), _fake_packed(512, 256), "Q4_1")
    assert statics == ["linear", "linear"]
    assert {r["op"] for r in tuned.report()} == {"gguf_linear", "gguf_linear_silu_and_mul"}


def test_small_and_unpacked_weights_are_not_timed():
    clock, calls = FakeClock(), []
    mod = _fake_module(clock, "x", lambda m: 1.0, calls)
    tuned = TunedGguf(Tuner(None, clock=clock, threads=1), mod, mod, lambda d, t: d, None, None, buckets=BUCKETS)
    tuned.prepare(_fake_packed(32, 64), "Q4_1")  # 2048 elements
    flat = torch.zeros(512, 8 * 20, dtype=torch.uint8)  # the file's blocks (not repacked)
    assert tuned.prepare(flat, "Q4_1") is flat
    assert not tuned.tuner.plans and not calls


needs_amx = pytest.mark.skipif(
    quant_gguf_amx.amx_int8_unavailable_reason() is not None or load_quant_kernels() is None,
    reason="no AMX GGUF kernels here",
)


@needs_amx
def test_registered_ops_run_their_plan():
    ops = OpRegistry()
    tuner = Tuner(None, threads=1)
    cpu_quant.register_cpu_quant_ops(ops, CpuOptions(gguf_amx_bf16=True), tuner)
    assert "+tuned(" in ops.source("gguf_linear")
    gen = torch.Generator().manual_seed(2)
    n, k = 512, 256  # 2**17 elements: tuned
    raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=gen)
    raw[..., 0:2] = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).reshape(n, -1, 2)
    raw[..., 2:4] = (torch.randn(n, k // 32, generator=gen) * 0.05).half().view(torch.uint8).reshape(n, -1, 2)
    data = raw.reshape(n, -1)
    packed = ops.prepare_gguf_weight(data, "Q4_1")
    (plan,) = tuner.plans.values()
    vnni, amx = load_quant_kernels(), quant_gguf_amx.load_gguf_amx()
    kernels = {"vnni": vnni.gguf_linear_out, "amx_bf16": amx.gguf_bf16_linear_out}
    for rows in (1, 16, 40, 300):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        y = ops.gguf_linear(x, packed, "Q4_1")
        assert torch.equal(y, kernels[plan.choose(rows)](x, packed, 3, None)), rows
        expect = reference.gguf_linear(x, data, "Q4_1")
        assert ((y.float() - expect.float()).norm() / expect.float().norm()).item() < 2.5e-2
        gated = ops.gguf_linear_silu_and_mul(x, packed, "Q4_1")
        expect = reference.gguf_linear_silu_and_mul(x, data, "Q4_1")
        assert ((gated.float() - expect.float()).norm() / expect.float().norm()).item() < 3.5e-2
    assert rows > 256 and {p.op for p in tuner.plans.values()} == {"gguf_linear", "gguf_linear_silu_and_mul"}


@needs_amx
def test_tuning_off_keeps_the_vnni_kernel():
    ops = OpRegistry()
    cpu_quant.register_cpu_quant_ops(ops, CpuOptions(tune=False), None)
    assert "tuned" not in ops.source("gguf_linear")
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (512, 8, 20), dtype=torch.uint8, generator=gen)
    data[..., 0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x00], dtype=torch.uint8)  # d = 2**-8, m = 0
    packed = ops.prepare_gguf_weight(data.reshape(512, -1), "Q4_1")
    for rows in (1, 64, 300):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        assert torch.equal(ops.gguf_linear(x, packed, "Q4_1"), load_quant_kernels().gguf_linear_out(x, packed, 3, None))
