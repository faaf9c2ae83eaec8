"""MultiprocExecutor: ranks 1..N-1 as local processes (torch.multiprocessing, spawn)."""

from __future__ import annotations

import torch.multiprocessing as mp

from pagedserve.distributed.executor_base import DistributedExecutor
from pagedserve.distributed.worker import default_threads, run_worker_process

__all__ = ["MultiprocExecutor"]


class MultiprocExecutor(DistributedExecutor):
    def _prepare(self) -> str:
        return "127.0.0.1"

    def _start_workers(self) -> None:
        # spawn, not fork: the parent may hold threads (tokenizers, OpenMP) and device state.
        ctx = mp.get_context("spawn")
        threads = default_threads(self.config, self.world_size)
        self.procs = [
            ctx.Process(target=run_worker_process, args=(self.config, rank, self.init, threads),
                        name=f"pagedserve-worker-{rank}", daemon=True)
            for rank in range(1, self.world_size)
        ]
        for p in self.procs:
            p.start()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _dead_workers(self) -> list[str]:
        return [f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs, start=1) if p.exitcode is not None]

    def _stop_workers(self, graceful: bool) -> None:
        for p in self.procs:
            p.join(timeout=15 if graceful else 0.5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
