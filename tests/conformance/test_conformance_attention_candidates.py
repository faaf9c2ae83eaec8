"""The conformance kit's paged_attention cases (prefill chunks, chunks after cached
context, decodes, mixed batches, GQA, head sizes 64-128, block sizes 16 and 32,
windows, soft caps and sinks) against every attention candidate of the CPU platform
(platforms/cpu/attention_ops.py): native, AMX tiles and the AMX prefill split where the
CPU has AMX, the AVX-512 BF16 tiling and its prefill split where it has AVX-512 BF16 and
no AMX, and torch SDPA over gathered K/V."""

from __future__ import annotations

import pytest
import torch

from pagedserve.platforms.cpu.attention_ops import attention_candidates
from pagedserve.testing.op_checks import OP_CASES
from pagedserve.testing.target import select_target


@pytest.fixture(scope="module")
def cpu_target():
    return select_target("cpu")


@pytest.fixture(scope="module")
def candidates(cpu_kernels):
    return attention_candidates(cpu_kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["native", "amx", "amx_prefill", "bf16_tiles", "bf16_prefill", "sdpa"])
def test_candidate_passes_every_case(cpu_target, candidates, name, dtype):
    if name not in candidates:
        needs = "AVX-512 BF16 and no AMX" if name.startswith("bf16") else "AMX: amx_tile, amx_bf16, avx512_bf16"
        pytest.skip(f"{name}: not available on this CPU (needs {needs})")
    ran = 0
    for _desc, body in OP_CASES["paged_attention"](cpu_target, candidates[name], dtype, 0):
        body()
        ran += 1
    assert ran >= 7
