"""Batch invariance of the packed bf16 GEMM (kernels/cpu/linear.h).

Every output element of the packed kernel is one register tile's k loop in a fixed
order, whatever the row count, the row tile (1-6 rows) a row falls in, the row chunks
the threads split, and the row's position in the batch.  So a row's output must be
bit-identical alone and in any batch: the bf16 path's greedy outputs then do not depend
on what else is scheduled.  A kernel that splits K or routes some row counts to another
GEMM (oneDNN sums in another order) would break this, and these tests say so.
"""

from __future__ import annotations

import pytest
import torch
from native_build import native_build_failed

from pagedserve.kernels import build
from pagedserve.kernels.cpu import NativeCpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu.native import ISA_FEATURES

pytestmark = pytest.mark.timeout(600)

#: Batches sliced out of one 300-row input: (start, rows); rows cover every row-tile
#: size 1-6 and its tails, a single chunk and several chunks per column tile.
SLICES = ((0, 300), (0, 1), (7, 1), (299, 1), (3, 5), (10, 6), (41, 37), (100, 64), (150, 150))


@pytest.fixture(scope="module")
def packed_kernels() -> NativeCpuKernels:
    """The instruction set with the packed bf16 linear kernel (AVX-512 BF16)."""
    try:
        module, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    features = build.read_cpu_features()
    for isa in module.compiled_isas():
        if features and not ISA_FEATURES[isa] <= features:
            continue
        kernels = load_cpu_kernels(isa=isa)
        if kernels.has_packed_linear:
            return kernels
    pytest.skip("no runnable instruction set here has the packed bf16 linear kernel (AVX-512 BF16)")


def _check_rows(fn, x: torch.Tensor, full: torch.Tensor) -> None:
    """fn on each slice of x equals the same rows of fn on all of x, bit for bit."""
    for start, rows in SLICES:
        got = fn(x[start : start + rows])
        assert torch.equal(got, full[start : start + rows]), (start, rows)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 208), (34, 48)])
def test_packed_linear_rows_do_not_depend_on_the_batch(packed_kernels, threads, k, n):
    """Plain packed linear (with bias): any batch slice equals the full batch's rows."""
    gen = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(300, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = packed_kernels.pack_linear_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = packed_kernels.packed_linear(x, packed, b)
        assert full.isfinite().all() and full.abs().sum() > 0
        _check_rows(lambda xs: packed_kernels.packed_linear(xs, packed, b), x, full)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,d", [(576, 1536), (100, 48)])
def test_packed_linear_silu_and_mul_rows_do_not_depend_on_the_batch(packed_kernels, threads, k, d):
    """The gated packed kernel: any batch slice equals the full batch's rows."""
    gen = torch.Generator().manual_seed(k * 11 + d)
    x = torch.randn(300, k, generator=gen).bfloat16()
    w = (torch.randn(2 * d, k, generator=gen) / k**0.5).bfloat16()
    packed = packed_kernels.pack_linear_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = packed_kernels.packed_linear_silu_and_mul(x, packed, None)
        assert full.isfinite().all() and full.abs().sum() > 0
        _check_rows(lambda xs: packed_kernels.packed_linear_silu_and_mul(xs, packed, None), x, full)
    finally:
        torch.set_num_threads(before)
