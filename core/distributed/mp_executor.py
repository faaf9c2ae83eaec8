"""MultiprocExecutor: ranks 1..N-1 as local processes (torch.multiprocessing, spawn)."""

from __future__ import annotations

import functools

import torch.multiprocessing as mp

from pagedserve.distributed.executor_base import DistributedExecutor
from pagedserve.distributed.lifecycle import await_workers_ready, worker_error
from pagedserve.distributed.multinode import RemoteNodeWatch, multinode_init
from pagedserve.distributed.worker import default_threads, run_worker_process

__all__ = ["MultiprocExecutor"]


class MultiprocExecutor(DistributedExecutor):
    def _prepare(self) -> str:
        par = self.config.parallel
        if par.node_rank > 0:
            raise ValueError(
                f"node_rank={par.node_rank} runs workers only: start it with `pagedserve serve "
                "--node-rank N ...` (pagedserve.distributed.multinode.run_headless), not as an engine"
            )
        self._remote = RemoteNodeWatch(multinode_init(self.config, "")) if par.nnodes > 1 else None
        # One node: a loopback rendezvous; several: the head's address every node was given.
        return self.config.parallel.rendezvous_addr if self.config.parallel.nnodes > 1 else "127.0.0.1"

    def _start_workers(self) -> None:
        # spawn, not fork: the parent may hold threads (tokenizers, OpenMP) and device state.
        ctx = mp.get_context("spawn")
        # This machine's ranks: all but 0, or the head node's share (multi-node).
        local = self.world_size // self.config.parallel.nnodes
        threads = default_threads(self.config, local)
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, local)]
        self.status = [read for read, _ in pipes]
        self.procs = [
            ctx.Process(
                target=run_worker_process,
                args=(self.config, rank, self.init, threads, None, write),
                name=f"pagedserve-worker-{rank}",
                daemon=True,
            )
            for rank, (_, write) in enumerate(pipes, start=1)
        ]
        for p in self.procs:
            p.start()
        for _, write in pipes:
            write.close()  # the children hold it now: EOF on the read end means the worker is gone

    def _await_workers(self) -> None:
        # Before rank 0 waits in the rendezvous: a worker that dies on the way is reported
        # within seconds, not after the process group's timeout.
        await_workers_ready(self.procs, self.status, self.init.timeout_s)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _dead_workers(self) -> list[str]:
        dead = []
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                error = worker_error(self.status[rank - 1])
                dead.append(
                    f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}" + (f" ({error})" if error else "")
                )
        parallel = self.driver.parallel if self._remote is not None else None
        if parallel is not None:
            dead += self._remote.dead(parallel.store)  # worker nodes (multi-node)
        return dead

    def _stop_workers(self, graceful: bool) -> None:
        stop_processes(self.procs, graceful, self.status)

    def _stopper(self):
        return functools.partial(stop_processes, self.procs, conns=self.status)


def stop_processes(procs: list, graceful: bool, conns: list | None = None) -> None:
    """Wait for worker processes told to stop (graceful), else end them, then close their
    status pipes; never hangs."""
    for p in procs:
        p.join(timeout=15 if graceful else 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for conn in conns or ():
        conn.close()
