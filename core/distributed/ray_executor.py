"""RayExecutor: ranks 1..N-1 as Ray actors in a placement group.

Ray only places and watches the workers; the collectives are torch.distributed, as with
the mp executor.  ``ray.init()`` connects to a cluster started with ``ray start`` (or
``RAY_ADDRESS``), else starts a local one; a Ray already initialised by the caller is used
as is.  Rank 0 runs in the engine's process, on the machine it was started on.
"""

from __future__ import annotations

from pagedserve.distributed.executor_base import DistributedExecutor
from pagedserve.distributed.worker import default_threads, run_worker_process

__all__ = ["RayExecutor", "RayWorkerActor"]


class RayWorkerActor:
    """Body of a worker actor: ``run`` returns when the driver stops the workers."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, config, rank, init, threads) -> None:
        # Ray makes exactly the actor's assigned device visible: local index 0.
        run_worker_process(config, rank, init, threads, local_rank=0)


def connect_ray(what: str) -> str:
    """Attach to the Ray cluster of ``ray start`` (or RAY_ADDRESS) unless the program
    initialised Ray itself; this node's IP address.  ``what`` names the option that
    needs Ray in the error raised when it is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"{what} needs Ray: pip install 'ray>=2.9'") from exc
    if not ray.is_initialized():
        ray.init()
    return ray.util.get_node_ip_address()


class RayExecutor(DistributedExecutor):
    def _prepare(self) -> str:
        return connect_ray("distributed_executor_backend='ray'")

    def _start_workers(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_cpu = self.init.backend == "gloo"
        resource = "CPU" if on_cpu else "GPU"
        # Bundle 0 stands for rank 0 (the engine's process), so no actor takes its device.
        self.pg = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        ray.get(self.pg.ready(), timeout=self.init.timeout_s)
        threads = default_threads(self.config, self.world_size)
        actor_cls = ray.remote(RayWorkerActor)
        self.actors = []
        for rank in range(1, self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            opts = {"num_cpus": 1} if on_cpu else {"num_cpus": 0, "num_gpus": 1}
            self.actors.append(actor_cls.options(scheduling_strategy=strategy, **opts).remote())
        self.runs = [a.run.remote(self.config, rank, self.init, threads) for rank, a in enumerate(self.actors, start=1)]

    def _dead_workers(self) -> list[str]:
        import ray

        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        dead = []
        for rank, ref in enumerate(self.runs, start=1):
            if ref in ready:
                try:
                    ray.get(ref)
                    dead.append(f"worker rank {rank} (Ray actor) returned")
                except Exception as exc:  # the actor's error or its death, as Ray reports it
                    dead.append(
                        f"worker rank {rank} (Ray actor) failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}"
                    )
        return dead

    def _stop_workers(self, graceful: bool) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=15)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)
