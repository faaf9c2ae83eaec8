"""What a test does when a native extension it needs did not build.

On a machine with a C++ compiler (CI has one) a failed build is a defect: the test
fails, naming the extension and the compiler's first error.  Only where
PAGEDSERVE_NO_COMPILER=1 declares that the machine has no compiler does it skip.  An
extension that does not apply to the CPU (an instruction set it lacks) is not a build
failure: tests check that themselves and skip.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

import pytest

from pagedserve.kernels import build

__all__ = ["native_build_failed", "require_native"]


def native_build_failed(what: str, why: object) -> NoReturn:
    """Skip (PAGEDSERVE_NO_COMPILER=1) or fail: ``what`` did not build, because ``why``."""
    if build.no_compiler_declared():
        pytest.skip(f"{what} not built (PAGEDSERVE_NO_COMPILER=1): {why}")
    pytest.fail(
        f"{what} did not build: {why} (on a machine without a C++ compiler set PAGEDSERVE_NO_COMPILER=1 to skip)",
        pytrace=False,
    )


def require_native(
    loader: Callable[[], ModuleType | None], spec: Callable[[], build.ExtensionSpec], what: str
) -> ModuleType:
    """``loader()``'s module; where it gives None (its build failed, with a warning),
    native_build_failed with the loader's warning, else (the loader remembered an earlier
    failure) the error of building ``spec()`` again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = loader()
    if module is not None:
        return module
    if caught:
        native_build_failed(what, "; ".join(str(w.message) for w in caught))
    try:
        return build.load_extension(spec(), what)[0]
    except build.KernelBuildError as exc:
        native_build_failed(what, exc)
