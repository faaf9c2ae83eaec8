"""The Triton fused_moe kernel against the reference (the conformance kit's fused_moe
cases), under Triton's interpreter without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton.moe import align_by_expert, fused_moe_triton  # noqa: E402
from pagedserve.testing.op_checks import OP_CASES  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


class _Target:
    device = DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_moe_conforms(dtype):
    for _desc, body in OP_CASES["fused_moe"](_Target(), fused_moe_triton, dtype, 0, reference.prepare_moe_weights):
        body()


def test_align_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    row_index, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    assert block_expert.tolist() == [0, 1, 2, -1, -1, -1]  # ceil(6 / 4) + 4 blocks; expert 3 idle
    assert row_index[:12].tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, -1]
    assert (row_index[12:] == -1).all()


def test_triton_fused_moe_refuses_bad_arguments():
    x = torch.randn(2, 16)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe_triton(x, torch.randn(2, 32, 16), torch.randn(2, 16, 8), torch.ones(2, 1), ids)
    with pytest.raises(ValueError, match="topk_ids has dtype int32"):
        fused_moe_triton(x, torch.randn(2, 32, 16), torch.randn(2, 16, 16), torch.ones(2, 1), ids.int())
    with pytest.raises(ValueError, match="relu"):
        fused_moe_triton(x, torch.randn(2, 32, 16), torch.randn(2, 16, 16), torch.ones(2, 1), ids, "relu")
