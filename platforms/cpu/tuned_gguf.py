"""GGUF linears on repacked weights dispatched by measurement (platforms/cpu/tuning.py).

At load, ``prepare`` repacks a Q4_0/Q4_1/Q8_0 weight for the tiled kernels
(quant_ops.prepare_gguf_weight) and, on the first weight of each shape, times the
candidates that read that one packed copy at the row counts of :data:`tuning.BUCKETS`:

=============  ===================================================================
candidate      kernel
=============  ===================================================================
``vnni``       the tiled AVX-512 VNNI kernel (int8 activations per 32-value block)
``amx_bf16``   the block tiles dequantized per column pair to bf16 in L2 and
               multiplied on AMX-BF16 tiles (kernels/cpu/quant_gguf_amx.cpp; 16 rows
               and more: below, the dequantization alone costs more than the VNNI call)
``amx_int8``   the AMX int8 kernel (only with ``CpuOptions.gguf_amx``: it measured no
               faster than VNNI)
=============  ===================================================================

Each bucket then runs its fastest candidate; the weight itself is never duplicated.
``gguf_linear_silu_and_mul`` is tuned at its first call on a [gate; up] weight: the
gated VNNI kernel against the gated AMX-BF16 kernel (both write silu(gate) * up in one
pass).  Weights of fewer than ``TUNE_MIN_ELEMENTS`` elements and CPUs without AMX keep
the static choice (the VNNI kernel at every row count).

The two kernels round differently (int8 activations against bf16 ones), so a row's
result then depends on which bucket its step fell into: like the tuned bf16 path this
gives up bitwise batch invariance of the GGUF path; ``PAGEDSERVE_CPU_TUNE=0`` restores
the VNNI kernel at every row count (docs/kernels_cpu.md, "AMX-BF16 GGUF").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from pagedserve.kernels import quant_reference as qref
from pagedserve.platforms.cpu.tuning import BUCKETS, TUNE_SLICE_ROWS, Tuner, plan_rows

__all__ = ["TunedGguf", "AMX_BF16_MIN_ROWS", "TUNE_MIN_ELEMENTS"]

#: Row counts below which the AMX-BF16 candidate is not timed (one dequantization of the
#: weight per call costs more than the VNNI kernel's whole call there).
AMX_BF16_MIN_ROWS = 16
#: Weights with fewer elements keep the VNNI kernel untimed (test models).
TUNE_MIN_ELEMENTS = 1 << 16
_ROUTE = "_pagedserve_gguf_route"
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
Kernel = Callable[..., torch.Tensor]


class _Route:
    """One packed weight's kernel per bucket (plain and, once tuned, gated)."""

    def __init__(self, key: str, type_name: str, buckets: tuple[int, ...], linear: list[Kernel]) -> None:
        self.key, self.type_name, self.buckets, self.linear = key, type_name, buckets, linear
        self.type_id = qref.GGUF_TYPE_IDS[type_name]
        self.gated: list[Kernel] | None = None

    def pick(self, rows: int, table: list[Kernel]) -> Kernel:
        for b, fn in zip(self.buckets, table):
            if rows <= b:
                return fn
        return table[-1]


class TunedGguf:
    """The tuned ``prepare_gguf_weight`` / ``gguf_linear`` / ``gguf_linear_silu_and_mul``."""

    def __init__(
        self,
        tuner: Tuner,
        vnni: ModuleType,
        amx: ModuleType,
        prepare: Callable[[torch.Tensor, str], torch.Tensor],
        linear: Kernel,
        gated: Kernel,
        amx_int8: bool = False,
        buckets: tuple[int, ...] = BUCKETS,
        min_elements: int = TUNE_MIN_ELEMENTS,
    ) -> None:
        """``prepare``/``linear``/``gated``: the static ops (taken for everything the
        tuned ones do not route); ``vnni``/``amx``: the compiled modules."""
        self.tuner, self.static_prepare, self.static_linear, self.static_gated = tuner, prepare, linear, gated
        self.buckets, self.min_elements = buckets, max(min_elements, 1)
        self.kernels: dict[str, Kernel] = {"vnni": vnni.gguf_linear_out, "amx_bf16": amx.gguf_bf16_linear_out}
        if amx_int8:
            self.kernels["amx_int8"] = amx.gguf_linear_out
        # Tuned only where the VNNI kernel has its gated variant (else the static op).
        self.gated_kernels: dict[str, Kernel] | None = None
        if vnni.has_packed_gated():
            self.gated_kernels = {"vnni": vnni.gguf_linear_silu_out, "amx_bf16": amx.gguf_bf16_linear_silu_out}

    @staticmethod
    def _min_rows(name: str) -> int:
        return AMX_BF16_MIN_ROWS if name == "amx_bf16" else 1

    def _runners(self, kernels: dict[str, Kernel], packed: torch.Tensor, type_id: int):
        k = packed.shape[1] * 32

        def runner(name: str):
            fn = kernels[name]

            def make(rows: int):
                if rows < self._min_rows(name):
                    return None
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                return lambda: fn(x, packed, type_id, None)

            return make

        return {n: runner(n) for n in kernels}

    # -- load ---------------------------------------------------------------------------
    def prepare(self, data: torch.Tensor, type_name: str) -> torch.Tensor:
        """See reference.prepare_gguf_weight: the static repacking, the packed weight
        carrying its route where its type and size are tuned."""
        packed = self.static_prepare(data, type_name)
        if packed.dim() != 3 or type_name not in qref.GGUF_BASE_TYPES:
            return packed
        n, k = packed.shape[0] * 16, packed.shape[1] * 32
        if n * k < self.min_elements:
            return packed
        # A large weight (the LM head) is timed on its first column groups (a view).
        groups = min(packed.shape[0], TUNE_SLICE_ROWS // 16)
        key = f"N={n},K={k},{type_name}" + (f",timed_rows={groups * 16}" if groups < packed.shape[0] else "")
        type_id = qref.GGUF_TYPE_IDS[type_name]
        plan = self.tuner.tune("gguf_linear", key, self._runners(self.kernels, packed[:groups], type_id), self.buckets)
        chosen = [self.kernels[plan.chosen[b]] for b in plan.buckets]
        setattr(packed, _ROUTE, _Route(key, type_name, plan.buckets, chosen))
        return packed

    def prepare_op(self) -> Callable[[torch.Tensor, str], torch.Tensor]:
        def prepare_gguf_weight(data: torch.Tensor, type_name: str) -> torch.Tensor:
            """See reference.prepare_gguf_weight (TunedGguf.prepare)."""
            return self.prepare(data, type_name)

        prepare_gguf_weight.tuning_report = self.report  # type: ignore[attr-defined]
        return prepare_gguf_weight

    def report(self) -> list[dict]:
        """Rows of every GGUF plan cached for this machine (else those of this process)."""
        cache = self.tuner.cache
        plans = cache.plans() if cache is not None else self.tuner.plans.values()
        return plan_rows([p for p in plans if p.op in ("gguf_linear", "gguf_linear_silu_and_mul")])

    # -- step ---------------------------------------------------------------------------
    @staticmethod
    def _route(x: torch.Tensor, data: torch.Tensor, type_name: str) -> _Route | None:
        route: _Route | None = getattr(data, _ROUTE, None)
        if route is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype not in _NATIVE_DTYPES:
            return None
        return route if type_name == route.type_name else None

    def gguf_linear(
        self,
        x: torch.Tensor,
        data: torch.Tensor,
        type_name: str,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """See reference.gguf_linear; ``data`` as returned by :meth:`prepare`.  The routed
        kernels write x's dtype: float32 output comes from a float32 copy of x (the same
        values, so the same int8 blocks and bf16 tiles)."""
        route = self._route(x, data, type_name)
        if route is None or out_dtype not in (None, x.dtype, torch.float32):
            return self.static_linear(x, data, type_name, bias, out_dtype)
        if out_dtype == torch.float32:
            x = x.float()
        return route.pick(x.shape[0], route.linear)(x, data, route.type_id, bias)

    def gguf_linear_silu_and_mul(
        self, x: torch.Tensor, data: torch.Tensor, type_name: str, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See reference.gguf_linear_silu_and_mul; tuned at the first call on each shape."""
        route = self._route(x, data, type_name)
        if route is None or data.shape[0] % 2 or self.gated_kernels is None:
            return self.static_gated(x, data, type_name, bias)
        if route.gated is None:
            # A gated weight's halves are timed whole (gate and up are paired by position).
            runners = self._runners(self.gated_kernels, data, route.type_id)
            plan = self.tuner.tune("gguf_linear_silu_and_mul", route.key, runners, route.buckets)
            route.gated = [self.gated_kernels[plan.chosen[b]] for b in plan.buckets]
        return route.pick(x.shape[0], route.gated)(x, data, route.type_id, bias)
