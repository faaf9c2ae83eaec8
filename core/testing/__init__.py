"""Test helpers shipped with pagedserve: the platform conformance kit.

    pagedserve platforms check NAME                            # a pass/fail report
    pytest --pyargs pagedserve.testing.conformance --platform NAME

or, from Python, :func:`run_conformance`.  Names are imported lazily so that loading
the kit's pytest plugin (every pytest run in an environment with pagedserve) stays free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "run_conformance",
    "collect_checks",
    "select_target",
    "Target",
    "Check",
    "CheckSkipped",
    "CheckResult",
    "ConformanceReport",
    "TOLERANCES",
    "assert_matches",
    "make_tiny_llama",
    "TinyLlamaSpec",
]

_LAZY = {
    "run_conformance": "pagedserve.testing.kit",
    "collect_checks": "pagedserve.testing.kit",
    "select_target": "pagedserve.testing.target",
    "Target": "pagedserve.testing.target",
    "Check": "pagedserve.testing.checks",
    "CheckSkipped": "pagedserve.testing.checks",
    "CheckResult": "pagedserve.testing.checks",
    "ConformanceReport": "pagedserve.testing.checks",
    "TOLERANCES": "pagedserve.testing.op_checks",
    "assert_matches": "pagedserve.testing.op_checks",
    "make_tiny_llama": "pagedserve.testing.tiny_model",
    "TinyLlamaSpec": "pagedserve.testing.tiny_model",
}

if TYPE_CHECKING:
    from pagedserve.testing.checks import Check, CheckResult, CheckSkipped, ConformanceReport
    from pagedserve.testing.kit import collect_checks, run_conformance
    from pagedserve.testing.op_checks import TOLERANCES, assert_matches
    from pagedserve.testing.target import Target, select_target
    from pagedserve.testing.tiny_model import TinyLlamaSpec, make_tiny_llama


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedserve.testing' has no attribute {name!r}")
