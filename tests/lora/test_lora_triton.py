"""The Triton lora_linear kernels against the reference (conformance cases of
core/testing/op_checks.py), under Triton's interpreter without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels.triton.lora import lora_linear_triton  # noqa: E402
from pagedserve.testing.op_checks import OP_CASES  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_conforms(dtype):
    target = type("T", (), {"device": DEVICE})()
    for _desc, body in OP_CASES["lora_linear"](target, lora_linear_triton, dtype, 0):
        body()


def test_triton_lora_refuses_bad_arguments():
    y, x = torch.zeros(2, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_linear_triton(y, x, torch.zeros(1, 2, 5), torch.zeros(1, 8, 2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_slots has dtype int32"):
        lora_linear_triton(y, x, torch.zeros(1, 2, 4), torch.zeros(1, 8, 2), torch.zeros(2, dtype=torch.int32))
