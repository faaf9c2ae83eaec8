"""Fixtures of the KV cache op tests."""

from __future__ import annotations

import pytest
from native_build import native_build_failed

from pagedserve.kernels import build
from pagedserve.kernels.cpu import NativeCpuKernels, load_cpu_kernels
from tests.kernels.test_cpu_kernels import runnable_isas


@pytest.fixture(scope="module")
def every_isa() -> dict[str, NativeCpuKernels]:
    """The native CPU kernels of every instruction set this machine runs."""
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(mod)}
