"""apply_token_bitmask: the reference against a per-token loop, the native CPU kernel and
the Triton kernel (under TRITON_INTERPRET=1, small shapes) against the reference through
the op-check cases, and the manager's use of it for padded vocabularies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.platforms.ops import OpRegistry
from pagedserve.testing.op_checks import _apply_token_bitmask


def _loop(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = mask.shape[1]
    for i, r in enumerate(rows):
        for j in range(out.shape[1]):
            w = j // 32
            ok = w < words and (int(mask[i, w]) >> (j % 32)) & 1
            if not ok:
                out[r, j] = float("-inf")
    return out


@pytest.mark.parametrize("indices", [None, [2, 0]])
def test_reference_matches_a_plain_loop(indices):
    g = torch.Generator().manual_seed(0)
    rows = 3
    logits = torch.randn(rows, 100, generator=g)
    n = rows if indices is None else len(indices)
    mask = torch.randint(-(2**31), 2**31 - 1, (n, 3), generator=g).to(torch.int32)  # 96 bits < 100: padding
    want = _loop(logits, mask, list(range(rows)) if indices is None else indices)
    got = logits.clone()
    out = reference.apply_token_bitmask(got, mask, None if indices is None else torch.tensor(indices))
    assert out is got and torch.equal(got, want)
    assert got[:, 96:].isneginf().all() if indices is None else got[indices][:, 96:].isneginf().all()


def _run_cases(fn, dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> None:
    target = type("T", (), {"device": torch.device("cpu"), "ops": OpRegistry()})()
    for dtype in dtypes:
        for _desc, body in _apply_token_bitmask(target, fn, dtype, seed=1):
            body()


def test_reference_passes_its_own_checks():
    _run_cases(reference.apply_token_bitmask)


def test_native_cpu_kernel_matches_reference():
    from native_build import native_build_failed  # here: the file is also run outside pytest

    from pagedserve.kernels import build
    from pagedserve.kernels.cpu import load_cpu_kernels
    from pagedserve.platforms.options import CpuOptions

    if not CpuOptions.from_env().native_kernels:
        pytest.skip("PAGEDSERVE_CPU_KERNELS=0")
    kernels = load_cpu_kernels()
    if kernels is None:
        try:
            build.load_cpu_extension()
        except build.KernelBuildError as exc:
            native_build_failed("the native CPU kernels", exc)
        pytest.fail("the native CPU kernels built but load_cpu_kernels() gave None")
    _run_cases(kernels.apply_token_bitmask)
    # The op checks would catch a kernel that ignores a bad case: feed one.
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.apply_token_bitmask(torch.randn(2, 40), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]))


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch, sys; sys.path.insert(0, 'tests/kernels');"
        "from test_token_bitmask import _run_cases;"
        "from pagedserve.kernels.triton.bitmask import apply_token_bitmask;"
        "_run_cases(apply_token_bitmask, (torch.float32, torch.float16)); print('ok')"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
