"""The fused_moe reference (tokens grouped by expert) against a per-token loop written
from the formula, and the conformance kit's fused_moe cases catching a wrong kernel."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference


def _per_token(x, w13, w2, weights, ids, act):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            g = (
                torch.nn.functional.silu(h[:inter])
                if act == "silu"
                else torch.nn.functional.gelu(h[:inter], approximate="tanh")
            )
            out[t] += float(weights[t, k]) * (w2[e].double() @ (g * h[inter:]))
    return out


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 2, 1), (11, 4, 2), (5, 9, 3)])
def test_reference_matches_the_formula(tokens, experts, top_k, act):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 24, 40
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    got = reference.fused_moe(x, w13, w2, weights, ids, act)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _per_token(x, w13, w2, weights, ids, act), atol=1e-5, rtol=1e-5)


def test_reference_refuses_an_unknown_activation():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="relu"):
        reference.fused_moe(
            x,
            torch.randn(2, 8, 8),
            torch.randn(2, 8, 4),
            torch.ones(2, 1),
            torch.zeros(2, 1, dtype=torch.int64),
            "relu",
        )


def test_conformance_cases_pass_the_reference_and_catch_a_wrong_kernel():
    from pagedserve.testing.checks import Check
    from pagedserve.testing.op_checks import OP_CASES as _CASES

    class _Target:
        device = torch.device("cpu")

    def unweighted(x, w13, w2, weights, ids, activation="silu"):  # forgets the routing weights
        return reference.fused_moe(x, w13, w2, torch.ones_like(weights), ids, activation)

    for fn, ok in ((reference.fused_moe, True), (unweighted, False)):
        results = [Check(desc, body).run() for desc, body in _CASES["fused_moe"](_Target(), fn, torch.float32, 0)]
        assert results and all((r.status == "passed") == ok for r in results), [r.message for r in results]
