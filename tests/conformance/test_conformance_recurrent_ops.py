"""The conformance kit checks the recurrent-layer ops a platform registers: the reference
set passes in every dtype, and a wrong one (a state left un-updated, a chunk boundary
dropped, a fresh sequence reading its stale state, a carried scan state dropped) fails under the op's id."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import recurrent_reference as rref
from pagedserve.testing import ConformanceReport
from tests.conformance.fake_op_platform import check_ops, fake_platform

OPS = rref.RECURRENT_OP_NAMES


RecurrentFakePlatform = fake_platform("rfake")


def faulty(fault: str | None) -> dict[str, object]:
    impls = {name: getattr(rref, name) for name in OPS}
    if fault == "ssd-step-state-not-written":

        def step(x, dt, A, B, C, D, state):
            return rref.mamba2_ssd_step(x, dt, A, B, C, D, state.clone())

        impls["mamba2_ssd_step"] = step
    if fault == "gdn-drops-last-token":

        def gdn(q, k, v, g, beta, state, qsl, use_qk_l2norm=True, chunk_size=64):
            out = rref.gated_delta_rule(q, k, v, g, beta, state, qsl, use_qk_l2norm, chunk_size)
            out[int(qsl[-1]) - 1] = 0  # the last token, past a scan-chunk boundary, left at zero
            return out

        impls["gated_delta_rule"] = gdn
    if fault == "scan-drops-initial-state":

        def scan(x, dt, A, B, C, D, state, qsl, chunk_size=16):
            return rref.mamba1_scan(x, dt, A, B, C, D, state.zero_(), qsl, chunk_size)

        impls["mamba1_scan"] = scan
    if fault == "conv-ignores-has-state":

        def conv(x, weight, bias, conv_state, qsl, has_state, activation="silu"):
            return rref.causal_conv1d(x, weight, bias, conv_state, qsl, torch.ones_like(has_state), activation)

        impls["causal_conv1d"] = conv
    return impls


def check(fault: str | None) -> ConformanceReport:
    return check_ops(RecurrentFakePlatform, faulty(fault), only=["op:"])


@pytest.fixture(scope="module")
def healthy() -> ConformanceReport:
    return check(None)


def test_reference_recurrent_ops_pass_in_every_dtype(healthy):
    assert healthy.ok, healthy.format(verbose=False)
    assert set(healthy.overridden_ops) == set(OPS)
    ids = {r.id for r in healthy.results}
    assert {i.split("[")[0] for i in ids} == {f"op:{op}" for op in OPS}
    assert "op:gated_delta_rule[bfloat16-chunk16]" in ids and "op:mamba2_ssd_step[float32-6seqs]" in ids
    assert "op:mamba1_scan[bfloat16-chunk4]" in ids


@pytest.mark.parametrize(
    ("fault", "op"),
    [
        ("ssd-step-state-not-written", "mamba2_ssd_step"),
        ("gdn-drops-last-token", "gated_delta_rule"),
        ("conv-ignores-has-state", "causal_conv1d"),
        ("scan-drops-initial-state", "mamba1_scan"),
    ],
)
def test_a_wrong_recurrent_op_fails_under_its_name(healthy, fault, op):
    report = check(fault)
    assert not report.ok
    failed = {r.id for r in report.failed}
    assert failed and all(i.startswith(f"op:{op}[") for i in failed), sorted(failed)
    assert report.count("passed") == healthy.count("passed") - len(failed)
