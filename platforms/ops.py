"""The op registry: named ops that model code calls, overridable per platform.

Every op starts as the torch reference in :mod:`pagedserve.kernels.reference`;
plugins override ops through the ``pagedserve_register_ops`` hook.  Model code calls
``ops.paged_attention(...)`` and never knows which implementation runs; quantized
weights are handed their op (``ops.gguf_linear``, ``ops.fp8_linear``, ...) when they
load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.kernels import reference

__all__ = ["OpRegistry", "OpEntry"]


@dataclass(frozen=True)
class OpEntry:
    fn: Callable[..., Any]
    source: str


class OpRegistry:
    """A mapping from op name to implementation, with attribute access for speed."""

    def __init__(self) -> None:
        self._entries: dict[str, OpEntry] = {}
        for name in reference.OP_NAMES:
            self.register(name, getattr(reference, name), source="reference")
        # A fused op's default is the composition of this registry's own parts, looked up
        # at call time: a platform that overrides only the parts (e.g. a linear taking
        # its own prepared weights) gets them without registering the fused op.
        self.register("linear_silu_and_mul", self._linear_silu_and_mul, source="reference")

    def _linear_silu_and_mul(self, x, weight, bias=None):
        """See reference.linear_silu_and_mul: this registry's silu_and_mul(linear(...))."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def register(self, name: str, fn: Callable[..., Any], source: str = "") -> None:
        """Make ``name`` resolve to ``fn``; ``source`` says where it came from."""
        if not callable(fn):
            raise TypeError(f"op {name!r}: implementation {fn!r} is not callable")
        if not name.isidentifier():
            raise ValueError(f"op name {name!r} is not a valid identifier")
        self._entries[name] = OpEntry(fn, source or getattr(fn, "__module__", "?"))
        # Plain attribute so the hot path pays one attribute lookup per call.
        setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"no op named {name!r}; known ops: {', '.join(sorted(self._entries))}")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., Any]:
        return getattr(self, name)

    def source(self, name: str) -> str:
        return self._entries[name].source

    def names(self) -> list[str]:
        return list(self._entries)

    def table(self) -> list[tuple[str, str]]:
        return [(n, e.source) for n, e in self._entries.items()]
