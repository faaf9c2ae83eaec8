"""Checks, their results and the conformance report (no pytest needed).

A :class:`Check` is a named zero-argument function: it returns an optional detail
string when the platform conforms, raises ``AssertionError`` when it does not and
:class:`CheckSkipped` when the check does not apply.  The same check objects back
``pytest --pyargs pagedserve.testing.conformance`` and ``pagedserve platforms check``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Check", "CheckSkipped", "CheckResult", "ConformanceReport", "run_checks"]

Status = Literal["passed", "failed", "skipped"]


class CheckSkipped(Exception):
    """Raised by a check that does not apply to the platform (the message says why)."""


@dataclass(frozen=True)
class Check:
    """One conformance check.

    id: ``area:subject[case]``, e.g. ``op:silu_and_mul[float32-7x256]``; failures are
        reported under it, so it names the op (or platform member) at fault.
    fn: returns an optional detail string on success; raises AssertionError on
        non-conformance and CheckSkipped when the check does not apply.
    """

    id: str
    fn: Callable[[], str | None]

    def run(self) -> CheckResult:
        start = time.perf_counter()
        try:
            detail = self.fn() or ""
            status: Status = "passed"
        except CheckSkipped as exc:
            status, detail = "skipped", str(exc)
        except AssertionError as exc:
            status, detail = "failed", str(exc) or "assertion failed"
        except Exception as exc:  # a crashing implementation is a failure, reported with where it crashed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            status = "failed"
            detail = f"raised {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"
        return CheckResult(self.id, status, detail, time.perf_counter() - start)


@dataclass
class CheckResult:
    id: str
    status: Status
    message: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """The outcome of running the kit on one platform."""

    platform: str | None
    core_interface_version: str
    origin: str | None = None
    interface_version: str | None = None
    overridden_ops: dict[str, str] = field(default_factory=dict)
    results: list[CheckResult] = field(default_factory=list)
    error: str | None = None  # the platform could not be selected at all
    seconds: float = 0.0

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def ok(self) -> bool:
        """True when the platform was selected and no check failed."""
        return self.error is None and not self.failed and bool(self.results)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["summary"] = {s: self.count(s) for s in ("passed", "failed", "skipped")}
        return out

    @staticmethod
    def format_result(r: CheckResult, width: int = 0) -> str:
        """``PASS  op:linear[float32-7x64->128]  detail`` (FAIL, SKIP)."""
        label = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[r.status]
        msg = f"  {r.message}" if r.message else ""
        return f"{label}  {r.id.ljust(width)}{msg}".rstrip()

    def format(self, verbose: bool = True, lines: bool = True) -> str:
        """A human-readable report: a header, one line per check, the failures, a verdict.

        verbose: also list the checks that passed; lines: list checks at all (False
        when they were already printed one by one as they ran).
        """
        out = [f"conformance of platform {self.platform!r}" + (f" (from {self.origin})" if self.origin else "")]
        out.append(
            f"  interface: targets {self.interface_version or '?'}, pagedserve provides {self.core_interface_version}"
        )
        if self.error is not None:
            out.append(f"  error: {self.error}")
            out.append("FAILED: the platform could not be selected")
            return "\n".join(out)
        ops = ", ".join(f"{name} ({src})" for name, src in self.overridden_ops.items()) or "none (all reference)"
        out.append(f"  overridden ops: {ops}")
        width = max((len(r.id) for r in self.results), default=0)
        listed = [self.format_result(r, width) for r in self.results if verbose or r.status != "passed"]
        if lines and listed:
            out += ["", *listed]
        if self.failed and (verbose or not lines):  # else the lines above are the failures already
            out += ["", "failures:", *(f"  {r.id}: {r.message}" for r in self.failed)]
        verdict = "PASSED" if self.ok else "FAILED"
        out += [
            "",
            f"{verdict}: {self.count('passed')} passed, {self.count('failed')} failed, "
            f"{self.count('skipped')} skipped in {self.seconds:.1f}s",
        ]
        return "\n".join(out)


def run_checks(checks: list[Check], progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run every check (a failure never stops the others); ``progress`` sees each result."""
    results = []
    for check in checks:
        result = check.run()
        results.append(result)
        if progress is not None:
            progress(result)
    return results
