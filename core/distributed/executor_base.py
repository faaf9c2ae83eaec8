"""DistributedExecutor: rank 0 in the engine's process, ranks 1..N-1 elsewhere.

Subclasses only start, watch and stop the other ranks (local processes or Ray actors);
the step itself is the driver Worker's broadcast.  A worker that dies makes the next
step (or the step in flight, whose collective breaks) raise a RuntimeError naming the
dead rank; a worker that hangs is caught by the process group's timeout.  After a
failure the executor refuses further steps and ``shutdown()`` stops what is left.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable

from pagedserve.config import EngineConfig
from pagedserve.distributed.lifecycle import WorkerStartupError, claim_process_group, release
from pagedserve.distributed.parallel_state import DistInit, free_port
from pagedserve.distributed.worker import Worker
from pagedserve.executor.abstract import Executor
from pagedserve.executor.model_runner import StepOutput
from pagedserve.platforms import Platform
from pagedserve.scheduler import SchedulerOutput

__all__ = ["DistributedExecutor"]

logger = logging.getLogger(__name__)

# How long a broken collective may precede the OS noticing that the peer exited.
_DEATH_GRACE_S = 5.0


class DistributedExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform, source=None) -> None:
        par = config.parallel
        self.config = config
        self.world_size = par.world_size
        self._failure: RuntimeError | None = None
        self._closed = False
        addr = self._prepare()
        self.init = DistInit(
            master_addr=addr,
            master_port=par.master_port or free_port(addr),
            world_size=self.world_size,
            tp_size=par.tensor_parallel_size,
            pp_size=par.pipeline_parallel_size,
            backend=platform.dist_backend,
            timeout_s=par.distributed_timeout_s,
            nnodes=par.nnodes,
        )
        claim_process_group(self)
        self.driver = Worker(config, 0, self.init)
        self._start_workers()
        # Not bound to self, so that dropping the engine runs it (and so does interpreter exit).
        self._finalizer = weakref.finalize(self, release, self.driver, self._stopper())
        try:
            self._await_workers()
            self.num_blocks = self.driver.setup(source)
        except Exception as exc:
            err = self._fail(exc, "start-up")
            self.shutdown()
            raise err from exc
        self.driver_runner = self.driver.runner
        self.draft_runner = self.driver.draft

    # -- subclass hooks -------------------------------------------------------------------
    @abstractmethod
    def _prepare(self) -> str:
        """Get ready to place workers; return the address rank 0 listens on."""

    @abstractmethod
    def _start_workers(self) -> None:
        """Start ranks 1..N-1 (non-blocking: they meet rank 0 at the rendezvous)."""

    def _stopper(self) -> Callable[[bool], None]:
        """``_stop_workers`` as a callable that holds no reference to the executor."""
        return lambda graceful: None

    def _await_workers(self) -> None:
        """Block until the workers are about to join the group; raise if one died first."""

    @abstractmethod
    def _dead_workers(self) -> list[str]:
        """A line per worker that is no longer running, naming its rank and why."""

    @abstractmethod
    def _stop_workers(self, graceful: bool) -> None:
        """Wait for workers told to stop (graceful) or end them; never hangs."""

    # -- Executor -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        self.check_health()
        try:
            return self.driver.execute_driver(out, block_ids)
        except Exception as exc:
            raise self._fail(exc, "step") from exc

    def forward_logits(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]], num_logits: list[int], draft: bool = False
    ):
        self.check_health()
        try:
            return self.driver.forward_logits_driver(out, block_ids, num_logits, draft)
        except Exception as exc:
            raise self._fail(exc, "step") from exc

    def sleep(self, level: int, transfers=None) -> None:
        # No host tier with several ranks (config rules), so no transfers.
        self.check_health()
        try:
            self.driver.control_driver("sleep", level)
        except Exception as exc:
            raise self._fail(exc, "sleep") from exc

    def wake_up(self) -> None:
        self.check_health()
        try:
            self.driver.control_driver("wake_up")
        except Exception as exc:
            raise self._fail(exc, "wake_up") from exc

    def check_health(self) -> None:
        if self._failure is None and not self._closed:
            dead = self._dead_workers()
            if dead:
                self._failure = RuntimeError(f"distributed executor: {'; '.join(dead)}")
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("distributed executor is shut down")

    def _fail(self, exc: BaseException, during: str) -> RuntimeError:
        if self._failure is None and isinstance(exc, WorkerStartupError):
            self._failure = RuntimeError(f"distributed executor failed during {during}: {exc}")
        if self._failure is None:
            deadline = time.monotonic() + _DEATH_GRACE_S
            while not (dead := self._dead_workers()) and time.monotonic() < deadline:
                time.sleep(0.1)
            why = "; ".join(dead) if dead else "no worker exited (a collective failed or timed out)"
            self._failure = RuntimeError(
                f"distributed executor failed during {during}: {why}: {type(exc).__name__}: {exc}"
            )
        return self._failure

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        graceful = self._failure is None and self.driver.runner is not None
        if graceful:
            try:
                self.driver.stop_workers()
            except RuntimeError as exc:  # a worker died between the last step and now
                logger.warning("could not tell workers to stop: %s", exc)
                graceful = False
        self._finalizer.detach()
        self._stop_workers(graceful)
        self.driver.close()
