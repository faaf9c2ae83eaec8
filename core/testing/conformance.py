"""The platform conformance kit as a pytest module: one test per check.

    pytest --pyargs pagedserve.testing.conformance --platform NAME [-k op:linear] [-x]

Options come from :mod:`pagedserve.testing.pytest_plugin` (``--platform``,
``--conformance-model``, ``--conformance-seed``).  Without ``--platform`` the kit checks
``PAGEDSERVE_TARGET_DEVICE``, else the platform the engine would auto-select.  The
checks are those of ``pagedserve platforms check NAME``; ids look like
``op:silu_and_mul[float32-7x256]``, ``platform:memory`` or ``engine:greedy-vs-cpu-reference``.
"""

from __future__ import annotations

import pytest

from pagedserve.platforms import PlatformError
from pagedserve.testing.checks import Check, CheckSkipped
from pagedserve.testing.kit import collect_checks
from pagedserve.testing.target import select_target

__all__ = ["pytest_generate_tests", "test_conformance"]

_CHECKS = pytest.StashKey[list[Check]]()


def _checks(config: pytest.Config) -> list[Check]:
    """The checks of the requested platform, selected once per pytest session."""
    if _CHECKS in config.stash:
        return config.stash[_CHECKS]
    name = config.getoption("pagedserve_platform", None)
    try:
        target = select_target(name)
    except PlatformError as exc:
        message = str(exc)

        def fail() -> None:
            raise AssertionError(f"platform {name or '(auto)'} could not be selected: {message}")

        checks = [Check("platform:select", fail)]
    else:
        checks = collect_checks(
            target,
            model=config.getoption("pagedserve_conformance_model", None),
            seed=config.getoption("pagedserve_conformance_seed", 0) or 0,
        )
    config.stash[_CHECKS] = checks
    return checks


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_check" in metafunc.fixturenames:
        checks = _checks(metafunc.config)
        metafunc.parametrize("conformance_check", checks, ids=[c.id for c in checks])


def test_conformance(conformance_check: Check) -> None:
    """Run one check; AssertionError is the platform's non-conformance, reported by id."""
    try:
        detail = conformance_check.fn()
    except CheckSkipped as exc:
        pytest.skip(str(exc))
    if detail:
        print(f"{conformance_check.id}: {detail}")
