"""Start-up and release of a distributed engine's workers and process group.

Start-up: watching spawned worker processes until they are ready to join the process group.

Rank 0 waits in ``init_process_group`` for every rank; a worker that dies before it joins
(a script read from stdin or without an ``if __name__ == "__main__":`` guard cannot be
re-imported by a spawned child; a platform or model error on the worker) would leave it
waiting for the whole rendezvous timeout. So each worker first reports over a pipe that
it is about to join, or the error that stopped it, and rank 0 joins only once every worker
reported ready, watching their sentinels meanwhile: a death is an error within seconds.

Release: an engine frees its group and workers on ``shutdown()``, when it is garbage
collected, and at interpreter exit (a ``weakref.finalize``), so a later engine in the same
process can form its own group.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

__all__ = [
    "MAIN_GUARD_HINT",
    "StartupReporter",
    "WorkerStartupError",
    "await_workers_ready",
    "claim_process_group",
    "release",
    "worker_error",
]

MAIN_GUARD_HINT = (
    "workers are started with the 'spawn' method and re-import the main module: run the "
    'script from a file and create the engine under `if __name__ == "__main__":` (a script '
    "read from stdin, `python -`, cannot be re-imported)"
)


class WorkerStartupError(RuntimeError):
    """A worker process died or failed before the engine's process group was formed."""


class StartupReporter:
    """Worker side of the pipe: ``ready()`` just before joining, ``failed()`` on an error."""

    def __init__(self, conn: Connection | None) -> None:
        self.conn = conn

    def _send(self, message: tuple[str, str]) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(message)
        except (OSError, ValueError):
            pass  # the parent is gone or stopped listening; nothing to report to

    def ready(self) -> None:
        self._send(("ready", ""))

    def failed(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self._send(("error", text))


def await_workers_ready(procs: list[Any], conns: list[Connection], timeout_s: float) -> dict[int, str]:
    """Block until every worker reported ready; raise WorkerStartupError on the first that
    failed or died (naming its rank, exit code and error), or after ``timeout_s``.

    Args:
        procs: the worker processes of ranks 1..N (``multiprocessing.Process``).
        conns: the read ends of their status pipes, same order.
    Returns:
        rank -> error text reported by workers (empty when all is well).
    """
    pending = {conn: rank for rank, conn in enumerate(conns, start=1)}
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs, start=1)}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = ", ".join(str(r) for r in sorted(pending.values()))
            raise WorkerStartupError(f"worker rank(s) {ranks} did not start within {timeout_s:.0f} s")
        for ready in wait([*pending, *sentinels], timeout=left):
            if ready in pending:
                rank = pending[ready]
                try:
                    kind, text = ready.recv()
                except (EOFError, OSError):
                    kind, text = "died", ""
                if kind == "ready":
                    del pending[ready]
                    sentinels = {s: r for s, r in sentinels.items() if r != rank}
                    continue
                raise _dead(procs, rank, text)
            rank = sentinels[ready]
            text = worker_error(conns[rank - 1])
            raise _dead(procs, rank, text)
    return {}


def worker_error(conn: Connection, wait_s: float = 0.2) -> str:
    """The error a dead worker reported on its status pipe, or ""."""
    try:
        while not conn.closed and conn.poll(wait_s):
            kind, text = conn.recv()
            if kind == "error":
                return text
    except (EOFError, OSError):
        pass
    return ""


def _dead(procs: list[Any], rank: int, error: str) -> WorkerStartupError:
    proc = procs[rank - 1]
    proc.join(timeout=5)
    code = proc.exitcode
    status = f"exited with code {code}" if code is not None else "failed"
    if error:
        return WorkerStartupError(f"worker rank {rank} (pid {proc.pid}) {status} during start-up: {error}")
    return WorkerStartupError(
        f"worker rank {rank} (pid {proc.pid}) {status} before it could start (see its traceback "
        f"above); {MAIN_GUARD_HINT}"
    )


logger = logging.getLogger(__name__)


# -- one distributed engine per process at a time ---------------------------------------------
# torch.distributed has one default process group per process, so the engine that holds it
# is tracked here (a weak reference: the holder may be garbage already).
_holder: weakref.ref | None = None


def claim_process_group(executor: object) -> None:
    """Make ``executor`` the holder of this process's torch.distributed state.

    A previous engine that was dropped without ``shutdown()`` (``del llm``, or an unnamed
    ``LLM(...)``, possibly held in a reference cycle) is collected first, which releases
    its group and workers through its finalizer. One still referenced (``llm = LLM(...)``
    run twice: the old object lives until the new one is built) is shut down with a
    warning, and refuses further steps with an error that says why.
    """
    global _holder
    previous = _holder() if _holder is not None else None
    if previous is not None and not getattr(previous, "_closed", True):
        del previous
        gc.collect()
        previous = _holder() if _holder is not None else None
    if previous is not None and not getattr(previous, "_closed", True):
        logger.warning(
            "shutting down the earlier tensor/pipeline-parallel engine of this process: "
            "torch.distributed holds one process group per process"
        )
        previous.shutdown()
        previous._failure = RuntimeError(
            "this distributed engine was shut down because another tensor/pipeline-parallel engine "
            "was created in the same process (torch.distributed holds one process group per process)"
        )
    if dist.is_initialized():
        # Every pagedserve engine released its group by now (shut down or finalized): this
        # one is the caller's, and not ours to tear down.
        raise RuntimeError(
            "torch.distributed's default process group is already initialized in this process, not by "
            "pagedserve; destroy it (torch.distributed.destroy_process_group()) before creating a "
            "tensor/pipeline-parallel engine"
        )
    _holder = weakref.ref(executor)


def release(driver: Any, stop: Callable[[bool], None]) -> None:
    """Stop the workers and leave the process group: the finalizer of an executor that was
    never shut down (garbage collected, or still alive at interpreter exit)."""
    graceful = getattr(driver, "runner", None) is not None and dist.is_initialized()
    if graceful:
        try:
            driver.stop_workers()
        except Exception:  # noqa: BLE001 - a worker already gone; end them below
            graceful = False
    try:
        stop(graceful)
    finally:
        driver.close()
