"""Per-step trace of a running engine, one JSON line per event (off by default).

Set ``PAGEDSERVE_STEP_TRACE=/path/trace.jsonl`` before the engine starts to record what
sets a loaded server's latencies: every engine step (its scheduling, forward and
output-processing times, the requests it decoded and the prompt tokens it computed for
each prefilling request) and, in a server, every hand-over of a step's outputs to the
event loop (how long the outputs waited for the loop).  `benchmarks/serve_trace.py`
joins the trace with the inter-token gaps a client saw (docs/serving.md#latency-under-load).

Steps are traced in the synchronous step loop (the default); with ``async_scheduling``
only the hand-overs are.  Times are ``time.perf_counter()`` seconds: CLOCK_MONOTONIC, one clock for every process
of the machine, so a client on the same machine can compare its own stamps with them.
Lines:

- ``{"ev": "step", "t0", "t_sched", "t_fwd", "t_end", "decode": [ids], "prefill":
  {id: tokens}, "first": [ids], "outputs", "running", "waiting"}``: ``decode`` the
  requests that computed one known token (plus drafts), ``prefill`` the others with
  their chunk sizes, ``first`` the prefilling requests whose chunk ended their prompt
  (they sampled their first token), ``outputs`` how many request outputs the step
  returned;
- ``{"ev": "dispatch", "t_post", "t_loop", "t_done", "outputs"}``: a batch of outputs
  posted by the engine thread at ``t_post``, taken up by the event loop at ``t_loop``
  and routed to the request streams by ``t_done``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.scheduler import Scheduler, SchedulerOutput

__all__ = ["ENV_VAR", "StepTrace", "now"]

ENV_VAR = "PAGEDSERVE_STEP_TRACE"

now = time.perf_counter
logger = logging.getLogger(__name__)


class StepTrace:
    """Appends trace lines to one file; safe to call from the engine thread and the loop."""

    def __init__(self, path: str) -> None:
        # Line-buffered: a server killed at the end of a benchmark loses no step.
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives as long as the engine
        self._lock = threading.Lock()
        self._step: dict = {}  # the step in progress (engine thread only)

    @classmethod
    def from_env(cls, async_scheduling: bool = False) -> StepTrace | None:
        """The trace named by PAGEDSERVE_STEP_TRACE, or None (no tracing) when unset."""
        path = os.environ.get(ENV_VAR)
        if path and async_scheduling:
            # Its steps return the previous step's outputs: no one line per step to write.
            logger.warning("%s: with async_scheduling only output hand-overs are traced, not steps", ENV_VAR)
        return cls(path) if path else None

    def _write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def begin(self, t0: float, sched: SchedulerOutput) -> None:
        """A step started at ``t0`` has scheduled ``sched`` (before its forward runs)."""
        decode, prefill, first = [], {}, []
        for s in sched.scheduled:
            r = s.request
            # One known token after the prompt (drafts aside): a decode row.
            known = s.num_new_tokens - len(s.spec_token_ids)
            if known == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                decode.append(r.request_id)
            else:
                prefill[r.request_id] = s.num_new_tokens
                if s.samples:
                    first.append(r.request_id)
        self._step = {"ev": "step", "t0": t0, "t_sched": now(), "decode": decode, "prefill": prefill, "first": first}

    def forward_done(self) -> None:
        self._step["t_fwd"] = now()

    def end(self, scheduler: Scheduler, outputs: int) -> None:
        """The step returns ``outputs`` request outputs."""
        record, self._step = self._step, {}
        record.update(t_end=now(), outputs=outputs, running=scheduler.num_running, waiting=scheduler.num_waiting)
        self._write(record)

    def dispatch(self, t_post: float, t_loop: float, outputs: int) -> None:
        """The event loop routed ``outputs`` request outputs posted at ``t_post``."""
        self._write({"ev": "dispatch", "t_post": t_post, "t_loop": t_loop, "t_done": now(), "outputs": outputs})

    def close(self) -> None:
        with self._lock:
            self._file.close()
