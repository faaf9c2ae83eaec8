"""bf16 linear layers dispatched by measurement (platforms/cpu/tuning.py).

At load, ``prepare`` times every candidate on the first weight of each shape at the row
counts of :data:`tuning.BUCKETS` (once per shape; the cache makes later loads free):

==================  ==========  =============================================
candidate           layout      kernel
==================  ==========  =============================================
``native_packed``   ``native``  the packed AVX-512 BF16 GEMM (kernels/cpu/linear.h)
``onednn``          ``onednn``  ``mkldnn._linear_pointwise`` on oneDNN's packing
                                (AMX tiles where the CPU has them)
``torch``           ``plain``   ``torch.nn.functional.linear``
``native_skinny``   ``plain``   the skinny kernel (<= 4 rows)
==================  ==========  =============================================

A weight's layout is decided at load, so the choice is per shape: the **primary** layout
is the one whose best candidate has the smallest geometric mean, over the buckets, of
its time over the fastest candidate's, capped at ``RATIO_CAP`` (every bucket counts
alike, a 1-row decode as much as a prefill chunk; the cap keeps one figure spoilt by
load from deciding).  Where another layout is more than ``DUAL_GAIN`` faster at some
bucket, the weight is also kept in that layout while the dual-layout memory budget
(``PAGEDSERVE_CPU_TUNE_DUAL_MB``) lasts, and each bucket runs the faster of the two.
On the Xeon with AMX the native kernel wins 1-4 rows and oneDNN the rest, so both are
kept there; where one layout wins everywhere nothing is duplicated.

Weights of fewer than ``TUNE_MIN_ELEMENTS`` elements are not timed (the static order);
weights of more than ``tuning.TUNE_SLICE_ROWS`` output rows (the LM head) are timed on
their first rows (the key says ``timed_rows=``), which is several times cheaper.

``linear_silu_and_mul`` is tuned at its first call on a weight (gate/up weights look
like any other at load): the native fused kernel where the weight has the native layout,
against ``silu_and_mul`` after each layout's linear.

Dispatching between kernels by row count gives up bitwise batch invariance of the bf16
path (oneDNN sums in another order than the native kernel, and at another order for
each row count); ``PAGEDSERVE_CPU_TUNE=0`` restores the static, batch-invariant choice
(docs/kernels_cpu.md, "Measured dispatch").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.platforms.cpu import dense_ops
from pagedserve.platforms.cpu.tuning import BUCKETS, TUNE_SLICE_ROWS, Plan, Tuner, geometric_mean, plan_rows

__all__ = ["TunedLinear", "Route", "choose_layouts", "DUAL_GAIN", "CANDIDATE_LAYOUT", "TUNE_MIN_ELEMENTS"]

log = logging.getLogger(__name__)

#: Weights with fewer elements take the static order untimed: their calls cost a few
#: microseconds whichever kernel runs, less than timing them would (test models).
TUNE_MIN_ELEMENTS = 1 << 16
#: Keep a second layout only where it is this much faster at some bucket.
DUAL_GAIN = 1.25
#: A layout's time over the best at one bucket counts at most this much in its score.
RATIO_CAP = 3.0
#: The layout each linear candidate reads.
CANDIDATE_LAYOUT = {"native_packed": "native", "onednn": "onednn", "torch": "plain", "native_skinny": "plain"}
_ROUTE = "_pagedserve_route"
Linear = Callable[..., torch.Tensor]


@dataclass
class Route:
    """How one prepared weight runs: per bucket, the kernel and the weight it reads."""

    key: str
    buckets: tuple[int, ...]
    entries: list[tuple[Linear, torch.Tensor]]
    layouts: dict[str, torch.Tensor]
    gated: list[tuple[Linear, torch.Tensor]] | None = field(default=None)

    def pick(self, rows: int, table: list[tuple[Linear, torch.Tensor]]) -> tuple[Linear, torch.Tensor]:
        for b, entry in zip(self.buckets, table):
            if rows <= b:
                return entry
        return table[-1]


def choose_layouts(plan: Plan, layout_of: dict[str, str], dual: bool) -> tuple[str, str | None]:
    """(primary layout, second layout or None) for ``plan`` (see the module docstring)."""
    per_layout: dict[str, dict[int, float]] = {}
    for b, times in plan.times.items():
        for cand, s in times.items():
            lay = per_layout.setdefault(layout_of[cand], {})
            lay[b] = min(lay.get(b, float("inf")), s)
    best = {b: min(t.values()) for b, t in plan.times.items()}

    def score(layout: str) -> float:
        t = per_layout[layout]
        if len(t) < len(best):
            return float("inf")
        # Capped: one bucket's figure spoilt by a descheduled thread must not decide.
        return geometric_mean([min(t[b] / best[b], RATIO_CAP) for b in best])

    primary = min(sorted(per_layout), key=score)
    if not dual:
        return primary, None
    # The layout that is fastest where the primary lags most.
    lag = {b: per_layout[primary].get(b, float("inf")) / best[b] for b in best}
    worst = max(lag, key=lag.__getitem__)
    if lag[worst] <= DUAL_GAIN:
        return primary, None
    second = min((lay for lay in per_layout if lay != primary), key=lambda lay: per_layout[lay].get(worst, 1e30))
    return primary, second


class TunedLinear:
    """The tuned ``prepare_linear_weight`` / ``linear`` / ``linear_silu_and_mul`` trio."""

    def __init__(
        self,
        tuner: Tuner,
        native,
        plain: Linear,
        silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
        dual_bytes: int,
        buckets: tuple[int, ...] = BUCKETS,
        min_elements: int = TUNE_MIN_ELEMENTS,
        slice_rows: int = TUNE_SLICE_ROWS,
    ) -> None:
        self.tuner, self.native, self.silu_and_mul = tuner, native, silu_and_mul
        self.slice_rows = max(int(slice_rows), 16)
        self.buckets, self.min_elements = buckets, max(min_elements, 1)
        self.dual_bytes_left = dual_bytes
        self.static_linear = dense_ops.make_linear(plain, native)
        self.static_gated = dense_ops.make_linear_silu_and_mul(self.static_linear, silu_and_mul, native)
        self.kernels: dict[str, Linear] = {"torch": torch.nn.functional.linear}
        if dense_ops.onednn_available():
            self.kernels["onednn"] = lambda x, w, b=None: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        if native is not None:
            self.kernels["native_packed"] = native.packed_linear
            if native.has_linear:
                self.kernels["native_skinny"] = native.linear

    # -- load ---------------------------------------------------------------------------
    def _pack(self, layout: str, w: torch.Tensor, kept: bool = True) -> torch.Tensor | None:
        """``w`` in ``layout``; ``kept``: for the model (the native layout then goes to the
        kernels' huge-page arena), else a copy only timed."""
        if layout == "native":
            return self.native.pack_linear_weight(w, arena=kept) if self.native is not None else None
        if layout == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        return w

    def _builds(self, candidates) -> dict[str, str]:
        """The native kernels' build for each candidate that runs them (the tuning cache
        files their figures under it: a rebuilt kernel is timed again)."""
        if self.native is None:
            return {}
        build = getattr(self.native.module, "__name__", "")
        return {c: build for c in candidates if c.startswith("native")}

    def _available(self, n: int, k: int) -> set[str]:
        """Layouts a [n, k] bf16 weight can take here (without packing it)."""
        out = {"plain"}
        if "onednn" in self.kernels:
            out.add("onednn")
        if self.native is not None and self.native.has_packed_linear and n % 16 == 0 and k % 2 == 0:
            out.add("native")
        return out

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """See reference.prepare_linear_weight: a bf16 2-D CPU weight -> its primary
        layout, carrying its route (``_pagedserve_route``); anything else as the static
        dense_ops.prepare_linear_weight."""
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.device.type != "cpu"
            or weight.is_mkldnn
            or weight.numel() < self.min_elements
        ):
            return dense_ops.prepare_linear_weight(weight, self.native)
        n, k = weight.shape
        # A large weight (the LM head) is timed on a slice of its rows, packed apart: the
        # kernels' work per output row is the same, the timing many times cheaper.
        timed_rows = min(n, self.slice_rows)
        key = f"N={n},K={k},bfloat16" + (f",timed_rows={timed_rows}" if timed_rows < n else "")
        avail = self._available(n, k)
        packed: dict[str, torch.Tensor] = {}
        timed: dict[str, torch.Tensor] = {}

        def layout(lay: str) -> torch.Tensor:
            if lay not in packed:
                packed[lay] = self._pack(lay, weight, kept=False)
            return packed[lay]

        def timed_layout(lay: str) -> torch.Tensor:
            if timed_rows == n:
                return layout(lay)
            if lay not in timed:
                timed[lay] = self._pack(lay, weight[:timed_rows], kept=False)
            return timed[lay]

        def runner(cand: str):
            fn = self.kernels[cand]

            def make(rows: int):
                if cand == "native_skinny" and rows > 4:
                    return None  # it hands larger batches to torch: the "torch" candidate
                x, w = torch.randn(rows, k, dtype=torch.bfloat16), timed_layout(CANDIDATE_LAYOUT[cand])
                return lambda: fn(x, w, None)

            return make

        cands = {c: runner(c) for c in self.kernels if CANDIDATE_LAYOUT[c] in avail}
        plan = self.tuner.tune("linear", key, cands, self.buckets, self._builds(cands))
        timed.clear()
        nbytes = weight.numel() * weight.element_size()
        primary, second = choose_layouts(plan, CANDIDATE_LAYOUT, self.dual_bytes_left >= nbytes)
        if second is not None:
            self.dual_bytes_left -= nbytes
        # The native layout is packed again for keeps, into the kernels' huge-page arena
        # (the copy timed above may be dropped, and would leave a hole there).
        kept = [lay for lay in (primary, second) if lay is not None]
        keep = {lay: self._pack(lay, weight) if lay == "native" else layout(lay) for lay in kept}
        entries = []
        for b in plan.buckets:
            times = {c: s for c, s in plan.times[b].items() if CANDIDATE_LAYOUT[c] in keep}
            cand = min(times, key=times.__getitem__)
            entries.append((self.kernels[cand], keep[CANDIDATE_LAYOUT[cand]]))
        out = keep[primary]
        setattr(out, _ROUTE, Route(key, plan.buckets, entries, keep))
        return out

    def prepare_op(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`prepare` as the registry's op, carrying ``tuning_report()``: the rows of
        every plan of this machine's cache (``pagedserve platforms --ops`` prints them)."""

        def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor:
            """See reference.prepare_linear_weight (TunedLinear.prepare)."""
            return self.prepare(weight)

        prepare_linear_weight.tuning_report = self.report  # type: ignore[attr-defined]
        return prepare_linear_weight

    def report(self) -> list[dict]:
        """Rows of every plan cached for this machine (else those of this process)."""
        cache = self.tuner.cache
        plans = cache.plans() if cache is not None else self.tuner.plans.values()
        # The tuner is shared with other ops (paged_attention), which report their own.
        return plan_rows([p for p in plans if p.op in ("linear", "linear_silu_and_mul")])

    # -- step ---------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See reference.linear; ``weight`` as returned by :meth:`prepare`."""
        route: Route | None = getattr(weight, _ROUTE, None)
        # dtypes are singletons (``is``); a 2-D x (every decode linear) has its rows first.
        rows = x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)
        if route is None or rows == 0 or x.dtype is not torch.bfloat16 or (bias is not None and bias.dtype != x.dtype):
            return self.static_linear(x, weight, bias)
        fn, w = route.pick(rows, route.entries)
        return fn(x, w, bias)

    def linear_silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """See reference.linear_silu_and_mul; tuned at the first call on each shape."""
        route: Route | None = getattr(weight, _ROUTE, None)
        rows = x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)
        if route is None or rows == 0 or x.dtype is not torch.bfloat16 or (bias is not None and bias.dtype != x.dtype):
            return self.static_gated(x, weight, bias)
        if route.gated is None:
            route.gated = self._tune_gated(route)
        fn, w = route.pick(rows, route.gated)
        return fn(x, w, bias)

    def _gated_kernels(self, route: Route) -> dict[str, tuple[Linear, torch.Tensor]]:
        silu = self.silu_and_mul
        out: dict[str, tuple[Linear, torch.Tensor]] = {}
        native = route.layouts.get("native")
        if native is not None and native.shape[0] % 2 == 0:
            out["native_fused"] = (self.native.packed_linear_silu_and_mul, native)
        for cand, fn in self.kernels.items():
            w = route.layouts.get(CANDIDATE_LAYOUT[cand])
            if w is not None and cand != "native_skinny" and not (cand == "native_packed" and "native_fused" in out):
                out[f"{cand}+silu"] = ((lambda x, w, b=None, fn=fn: silu(fn(x, w, b))), w)
        return out

    def _tune_gated(self, route: Route) -> list[tuple[Linear, torch.Tensor]]:
        kernels = self._gated_kernels(route)
        k = int(route.key.split(",")[1].removeprefix("K="))

        def runner(name: str):
            fn, w = kernels[name]

            def make(rows: int):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                return lambda: fn(x, w, None)

            return make

        cands = {n: runner(n) for n in kernels}
        plan = self.tuner.tune("linear_silu_and_mul", route.key, cands, route.buckets, self._builds(cands))
        return [kernels[plan.chosen[b]] for b in plan.buckets]
