"""The op checks of a target: every op it overrides against the reference, on the
cases of :mod:`pagedserve.testing.op_checks` (dense ops) and
:mod:`pagedserve.testing.quant_op_checks` (quantized linear ops, which build on the
dense module's helpers; assembling both here keeps the two free of a circle) and
:mod:`pagedserve.testing.recurrent_op_checks` (the recurrent layers' ops).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.testing.checks import Check, CheckSkipped
from pagedserve.testing.op_checks import OP_CASES, Body, _dtype_name
from pagedserve.testing.quant_op_checks import QUANT_CASES
from pagedserve.testing.recurrent_op_checks import RECURRENT_CASES
from pagedserve.testing.target import Target

__all__ = ["op_checks"]


def _failing_for(name: str, source: str, body: Body) -> Callable[[], None]:
    """Prefix a failure with the op and where its implementation came from."""

    def run() -> None:
        try:
            body()
        except AssertionError as exc:
            raise AssertionError(f"op {name} (from {source}): {exc}") from None

    return run


def op_checks(target: Target, seed: int = 0) -> list[Check]:
    """One check per (overridden op, dtype, case); ops left to the reference are not checked."""
    checks: list[Check] = []
    for name, source in target.overridden_ops().items():
        cases = OP_CASES.get(name) or QUANT_CASES.get(name) or RECURRENT_CASES.get(name)
        if cases is None:

            def skip(name=name) -> None:
                raise CheckSkipped(f"{name!r} is not an op of pagedserve.kernels.reference: nothing to compare with")

            checks.append(Check(f"op:{name}", skip))
            continue
        fn = target.ops.get(name)
        for dtype in target.dtypes():
            for desc, body in cases(target, fn, dtype, seed):
                checks.append(Check(f"op:{name}[{_dtype_name(dtype)}-{desc}]", _failing_for(name, source, body)))
    return checks
