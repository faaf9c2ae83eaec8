"""The conformance kit's front door: which checks a platform gets, and running them.

    from pagedserve.testing import run_conformance
    report = run_conformance("ort")
    print(report.format()); assert report.ok

``pagedserve platforms check NAME`` prints that report; ``pytest --pyargs
pagedserve.testing.conformance --platform NAME`` runs the same checks as tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedserve.platforms import PlatformError, PlatformRegistry
from pagedserve.platforms.interface import PLATFORM_INTERFACE_VERSION
from pagedserve.testing.checks import Check, CheckResult, ConformanceReport, run_checks
from pagedserve.testing.connector_checks import connector_checks
from pagedserve.testing.engine_check import engine_greedy_check
from pagedserve.testing.op_suite import op_checks
from pagedserve.testing.platform_checks import platform_checks
from pagedserve.testing.target import Target, select_target

__all__ = ["collect_checks", "run_conformance", "ENGINE_CHECK_ID"]

ENGINE_CHECK_ID = "engine:greedy-vs-cpu-reference"


def collect_checks(
    target: Target,
    *,
    engine: bool = True,
    model: str | Path | None = None,
    seed: int = 0,
    only: Iterable[str] | None = None,
) -> list[Check]:
    """The checks for ``target``: its Platform members, every op it overrides, the KV
    connectors plugins register, and (``engine=True``) greedy generation against the
    CPU reference.

    model: checkpoint for the engine check (None: a tiny random Llama made on the spot).
    seed: mixed into every case's generator; change it to draw other random inputs.
    only: keep the checks whose id starts with one of these prefixes (``op:linear``,
        ``platform:``) -- for iterating on one op; a conformance claim needs them all.
    """
    checks = platform_checks(target) + op_checks(target, seed) + connector_checks(target)
    if engine:
        checks.append(Check(ENGINE_CHECK_ID, lambda: engine_greedy_check(target, model)))
    if only is not None:
        prefixes = tuple(only)
        checks = [c for c in checks if c.id.startswith(prefixes)]
    return checks


def run_conformance(
    name: str | None = None,
    *,
    registry: PlatformRegistry | None = None,
    env: dict[str, str] | None = None,
    engine: bool = True,
    model: str | Path | None = None,
    seed: int = 0,
    only: Iterable[str] | None = None,
    progress: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Select platform ``name`` (None: the one the engine would pick) and run every check.

    Never raises for a non-conforming or unselectable platform: that is what the
    report says (``report.ok``, ``report.error``, ``report.failed``).  The keyword
    arguments are those of :func:`collect_checks`; ``progress`` sees each result as it
    comes.
    """
    start = time.perf_counter()
    report = ConformanceReport(platform=name, core_interface_version=PLATFORM_INTERFACE_VERSION)
    try:
        target = select_target(name, registry=registry, env=env)
    except PlatformError as exc:
        report.error = str(exc)
        return report
    report.platform = target.name
    report.origin = target.info.origin
    report.interface_version = target.info.cls.interface_version
    report.overridden_ops = target.overridden_ops()
    checks = collect_checks(target, engine=engine, model=model, seed=seed, only=only)
    report.results = run_checks(checks, progress)
    report.seconds = time.perf_counter() - start
    return report
