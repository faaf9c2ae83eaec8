"""Executors: how the engine runs one step on one or many ranks.

- ``UniProcExecutor``: today's ModelRunner in the engine's process (the default).
- ``MultiprocExecutor`` (``distributed_executor_backend="mp"``): ranks 1..N-1 are local
  worker processes; rank 0 runs in the engine's process.
- ``RayExecutor`` (``"ray"``): ranks 1..N-1 are Ray actors in a placement group, on one
  machine or many.

All of them expose ``execute(scheduler_output, block_ids) -> StepOutput``,
``num_blocks`` (agreed by every rank), ``driver_runner`` (rank 0's runner, which owns
the sampler) and ``shutdown()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.config import EngineConfig
from pagedserve.executor.model_runner import ModelRunner, StepOutput
from pagedserve.models.llama import ArchConfig
from pagedserve.platforms import OpRegistry, Platform
from pagedserve.scheduler import SchedulerOutput

__all__ = ["Executor", "UniProcExecutor", "MultiprocExecutor", "RayExecutor", "create_executor",
           "EXECUTOR_BACKENDS"]

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


class Executor(ABC):
    driver_runner: ModelRunner
    num_blocks: int

    @abstractmethod
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        """Run one scheduled step on every rank; sampled tokens come from rank 0."""

    def check_health(self) -> None:
        """Raise RuntimeError if a worker is gone."""

    def shutdown(self) -> None:
        """Stop workers and release the process group; safe to call twice."""


class UniProcExecutor(Executor):
    """One process, no communication: the ModelRunner as the engine always used it."""

    def __init__(self, config: EngineConfig, platform: Platform, ops: OpRegistry, arch: ArchConfig,
                 dtype: torch.dtype, source, max_model_len: int) -> None:
        self.driver_runner = runner = ModelRunner(platform, ops, arch, dtype)
        runner.load_weights(source.weights())
        self.num_blocks = runner.determine_num_blocks(config.cache, config.scheduler, max_model_len)
        runner.allocate_kv_cache(self.num_blocks, config.cache.block_size)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        return self.driver_runner.execute(out, block_ids)


def create_executor(config: EngineConfig, platform: Platform, ops: OpRegistry, arch: ArchConfig,
                    dtype: torch.dtype, source, max_model_len: int) -> Executor:
    """The executor ``config.parallel`` asks for (None: "uni" for one rank, else "mp")."""
    par = config.parallel
    world = par.tensor_parallel_size * par.pipeline_parallel_size
    backend = par.distributed_executor_backend or ("uni" if world == 1 else "mp")
    if backend == "uni":
        if world > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size * "
                             f"pipeline_parallel_size = {world}; use 'mp' or 'ray'")
        return UniProcExecutor(config, platform, ops, arch, dtype, source, max_model_len)
    if backend == "mp":
        from pagedserve.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, platform, source)
    if backend == "ray":
        from pagedserve.distributed.ray_executor import RayExecutor

        return RayExecutor(config, platform, source)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; got {backend!r}")


def __getattr__(name: str):
    # The multi-rank executors live in pagedserve.distributed (and Ray's import is heavy):
    # load them only when asked for.
    if name == "MultiprocExecutor":
        from pagedserve.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor
    if name == "RayExecutor":
        from pagedserve.distributed.ray_executor import RayExecutor

        return RayExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
