"""Features that take part in every step attach to the engine as hooks, so that the step
itself has no branch per feature: speculative decoding (drafts held back before
scheduling, verified in place of the plain forward, proposed after the step) and the
step trace (PAGEDSERVE_STEP_TRACE).  A hook overrides only what it needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.engine.step_trace import StepTrace
from pagedserve.engine.step_trace import now as trace_now

if TYPE_CHECKING:
    from pagedserve.executor.model_runner import StepOutput
    from pagedserve.scheduler import Scheduler, SchedulerOutput
    from pagedserve.spec_decode.decoder import SpecDecoder

__all__ = ["SpecDecodeHook", "StepHook", "TraceHook", "Forward"]

#: A step's forward: the scheduled step and its requests' block ids in, sampled tokens out.
Forward = Callable[["SchedulerOutput", dict], "StepOutput"]


class StepHook:
    """No-op defaults; the engine calls each hook in the order they were attached."""

    def before_schedule(self, scheduler: Scheduler) -> None:
        """Before the step is scheduled."""

    def forward(self, sched: SchedulerOutput, block_ids: dict, inner: Forward) -> StepOutput:
        """Run the step's forward; ``inner`` is the forward of the hooks after this one
        (the executor's at the end)."""
        return inner(sched, block_ids)

    def after_step(self, scheduler: Scheduler, num_outputs: int) -> None:
        """After the step's outputs are made."""

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted: drop what is kept for it."""

    def counters(self) -> dict[str, object]:
        """Counters for ``EngineStats``, named as its fields."""
        return {}


class SpecDecodeHook(StepHook):
    """Speculative decoding: drafts are proposed after a step and verified by the next."""

    def __init__(self, decoder: SpecDecoder) -> None:
        self.decoder = decoder

    def before_schedule(self, scheduler: Scheduler) -> None:
        self.decoder.hold_back(scheduler.running, scheduler.waiting)

    def forward(self, sched: SchedulerOutput, block_ids: dict, inner: Forward) -> StepOutput:
        # None: no scheduled request carries drafts; the executor runs the step as usual.
        return self.decoder.execute(sched, block_ids) or inner(sched, block_ids)

    def after_step(self, scheduler: Scheduler, num_outputs: int) -> None:
        self.decoder.propose(scheduler.running)

    def forget(self, request_id: str) -> None:
        self.decoder.forget(request_id)

    def counters(self) -> dict[str, object]:
        return self.decoder.counters()


class TraceHook(StepHook):
    """One JSON line per step that ran a forward (step_trace.py)."""

    def __init__(self, trace: StepTrace) -> None:
        self.trace = trace
        self._t0 = 0.0

    def before_schedule(self, scheduler: Scheduler) -> None:
        self._t0 = trace_now()

    def forward(self, sched: SchedulerOutput, block_ids: dict, inner: Forward) -> StepOutput:
        self.trace.begin(self._t0, sched)
        result = inner(sched, block_ids)
        self.trace.forward_done()
        return result

    def after_step(self, scheduler: Scheduler, num_outputs: int) -> None:
        self.trace.end(scheduler, num_outputs)
