"""Start, watch and stop data-parallel replicas: local processes (mp) or Ray actors (ray).

Like the executors of tensor/pipeline parallelism, a launcher only places processes;
requests and outputs travel over the connection each replica opens back to the router
(`launch` opens the listener, starts the replicas and waits for each to load its model).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection, Listener, wait

from pagedserve.config import EngineConfig
from pagedserve.serving.data_parallel import ReplicaSpec
from pagedserve.serving.replica import ReplicaActor, run_replica

__all__ = ["ReplicaLauncher", "MpReplicaLauncher", "RayReplicaLauncher", "create_launcher", "ReplicaStartError"]

logger = logging.getLogger(__name__)


class ReplicaStartError(RuntimeError):
    """A replica failed to load (its own error is in the message) or did not start in time."""


class ReplicaLauncher(ABC):
    #: The address replicas connect to (this machine as they can reach it).
    host: str = "127.0.0.1"

    @abstractmethod
    def start(self, spec: ReplicaSpec, config: EngineConfig, address, authkey: bytes, log_level: str) -> None:
        """Start replica ``spec.index`` (non-blocking: it connects back when up)."""

    @abstractmethod
    def exit_reason(self, index: int, wait_s: float = 0.0) -> str | None:
        """How replica ``index`` ended ("exited with code -9"), or None while it runs;
        waits up to ``wait_s`` for it to end (the connection may close first)."""

    @abstractmethod
    def stop(self, graceful_s: float) -> None:
        """Let replicas told to stop exit for ``graceful_s``, then end the rest; never hangs."""

    def launch(
        self, specs: list[ReplicaSpec], config: EngineConfig, log_level: str, timeout_s: float
    ) -> dict[int, tuple[Connection, dict]]:
        """Start every replica and wait until each has connected and loaded its model:
        {index: (connection, its "ready" info)}.  ReplicaStartError (and every replica
        ended) if one fails or the time runs out."""
        authkey = os.urandom(32)
        listener = Listener((self.host, 0), authkey=authkey)
        conns: dict[int, Connection] = {}
        try:
            for spec in specs:
                self.start(spec, config, listener.address, authkey, log_level)
            infos = self._await_ready(specs, listener, conns, time.monotonic() + timeout_s)
        except BaseException:
            for conn in conns.values():
                conn.close()
            self.stop(graceful_s=0.0)
            raise
        finally:
            listener.close()
        return {i: (conns[i], infos[i]) for i in infos}

    def _await_ready(
        self, specs: list[ReplicaSpec], listener: Listener, conns: dict[int, Connection], deadline: float
    ) -> dict[int, dict]:
        arrivals: queue.SimpleQueue[Connection] = queue.SimpleQueue()

        def accept() -> None:
            while True:
                try:
                    arrivals.put(listener.accept())
                except OSError:  # the listener is closed: start-up is over
                    return
                except Exception as exc:  # noqa: BLE001 - a stranger failing authentication
                    logger.warning("refused a connection to the replica listener: %s", exc)

        threading.Thread(target=accept, name="pagedserve-dp-accept", daemon=True).start()
        infos: dict[int, dict] = {}

        def failed(index: int, why: str) -> ReplicaStartError:
            return ReplicaStartError(
                f"data-parallel replica {index} ({specs[index].device or 'auto'}) failed to start: {why}"
            )

        while len(infos) < len(specs):
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(specs))) - set(infos))
                raise ReplicaStartError(
                    f"data-parallel replicas {missing} did not start in time (distributed_timeout_s)"
                )
            while not arrivals.empty():
                conn = arrivals.get()
                if conn.poll(30):
                    _, index, _pid = conn.recv()  # ("hello", index, pid)
                    conns[index] = conn
            pending = [conns[i] for i in conns if i not in infos]
            for conn in wait(pending, timeout=0.2) if pending else ():
                index = next(i for i, c in conns.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise failed(index, self.exit_reason(index, 5.0) or "connection closed") from None
                if msg[0] == "fatal":
                    raise failed(index, msg[1])
                infos[index] = msg[1]
            if not pending:
                time.sleep(0.2)
            for spec in specs:  # died before connecting
                if spec.index not in conns and (reason := self.exit_reason(spec.index)) is not None:
                    raise failed(spec.index, reason)
        return infos


class MpReplicaLauncher(ReplicaLauncher):
    def __init__(self, ranks_per_replica: int) -> None:
        import torch.multiprocessing as mp

        # spawn, not fork: this process holds threads (tokenizers, uvicorn) and device state.
        self._ctx = mp.get_context("spawn")
        # A replica with tensor/pipeline-parallel ranks starts worker processes itself,
        # which a daemon process may not; it exits on its own when the router goes away.
        self._daemon = ranks_per_replica == 1
        self.procs: dict[int, object] = {}

    def start(self, spec: ReplicaSpec, config: EngineConfig, address, authkey: bytes, log_level: str) -> None:
        proc = self._ctx.Process(
            target=run_replica,
            args=(spec, config, address, authkey, log_level),
            name=f"pagedserve-replica-{spec.index}",
            daemon=self._daemon,
        )
        proc.start()
        self.procs[spec.index] = proc

    def exit_reason(self, index: int, wait_s: float = 0.0) -> str | None:
        proc = self.procs[index]
        proc.join(timeout=wait_s)
        return None if proc.exitcode is None else f"exited with code {proc.exitcode}"

    def stop(self, graceful_s: float) -> None:
        deadline = time.monotonic() + graceful_s
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            for end in (proc.terminate, proc.kill):
                if proc.is_alive():
                    end()
                    proc.join(timeout=5)


class RayReplicaLauncher(ReplicaLauncher):
    """One Ray actor per replica: ``num_gpus=1`` for an accelerator replica, else as many
    CPUs as its threads.  ``ray.init()`` attaches to the cluster of ``ray start`` (or
    RAY_ADDRESS) unless the program initialised Ray itself."""

    def __init__(self) -> None:
        from pagedserve.distributed.ray_executor import connect_ray

        self.host = connect_ray("--data-parallel-backend ray")
        self.actors: dict[int, object] = {}
        self.runs: dict[int, object] = {}

    def start(self, spec: ReplicaSpec, config: EngineConfig, address, authkey: bytes, log_level: str) -> None:
        import ray

        opts = {"num_cpus": spec.threads} if spec.on_host else {"num_cpus": 1, "num_gpus": 1}
        actor = ray.remote(ReplicaActor).options(**opts).remote()
        self.actors[spec.index] = actor
        self.runs[spec.index] = actor.run.remote(spec, config, address, authkey, log_level)

    def exit_reason(self, index: int, wait_s: float = 0.0) -> str | None:
        import ray

        ref = self.runs[index]
        ready, _ = ray.wait([ref], timeout=wait_s)
        if not ready:
            return None
        try:
            ray.get(ref)
            return "Ray actor returned"
        except Exception as exc:  # the actor's error or its death, as Ray reports it
            first = str(exc).splitlines()[0] if str(exc) else ""
            return f"Ray actor failed: {type(exc).__name__}: {first}"

    def stop(self, graceful_s: float) -> None:
        import ray

        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=graceful_s)
        for actor in self.actors.values():
            ray.kill(actor)


def create_launcher(backend: str, ranks_per_replica: int) -> ReplicaLauncher:
    if backend == "ray":
        if ranks_per_replica > 1:
            raise ValueError(
                "--data-parallel-backend ray runs single-rank replicas only; use "
                "--data-parallel-backend mp for tensor/pipeline-parallel replicas"
            )
        return RayReplicaLauncher()
    return MpReplicaLauncher(ranks_per_replica)
