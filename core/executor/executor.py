"""Executors: how the engine runs one step on one or many ranks.

- ``UniProcExecutor``: today's ModelRunner in the engine's process (the default); the
  only one that runs a device map (layers split across platforms).
- ``MultiprocExecutor`` (``distributed_executor_backend="mp"``,
  :mod:`pagedserve.distributed.mp_executor`): ranks 1..N-1 are local worker processes;
  rank 0 runs in the engine's process.
- ``RayExecutor`` (``"ray"``, :mod:`pagedserve.distributed.ray_executor`): ranks 1..N-1
  are Ray actors in a placement group, on one machine or many.

``create_executor`` picks one; the multi-rank ones are imported only when chosen (Ray's
import is heavy).  They subclass :class:`pagedserve.executor.abstract.Executor`.

All of them expose ``execute(scheduler_output, block_ids) -> StepOutput``,
``num_blocks`` (agreed by every rank), ``driver_runner`` (rank 0's runner, which owns
the sampler) and ``shutdown()``.
"""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig, vision_inputs_on
from pagedserve.executor.abstract import Executor
from pagedserve.executor.model_runner import ModelRunner, StepOutput
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.registry import resolve_model_class
from pagedserve.offload.device_map import resolve_device_map, resolve_expert_segment
from pagedserve.platforms import OpRegistry, Platform
from pagedserve.scheduler import SchedulerOutput

__all__ = ["Executor", "UniProcExecutor", "create_executor", "EXECUTOR_BACKENDS"]

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


class UniProcExecutor(Executor):
    """One process, no communication: the ModelRunner as the engine always used it."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        ops: OpRegistry,
        arch: ArchConfig,
        dtype: torch.dtype,
        source,
        max_model_len: int,
    ) -> None:
        segments = experts = None
        device_map = config.device.device_map
        if device_map is not None:
            segments = resolve_device_map(device_map, arch.num_layers, platform, ops, dtype)
            model_cls = resolve_model_class(arch.architecture)
            experts = resolve_expert_segment(device_map, segments, dtype, model_cls, arch.hf_config)
            method = getattr(source, "method", None)  # a quantized source (pagedserve.quantization)
            names = sorted({s.platform.name for s in [*segments, *([experts] if experts else [])]})
            if method is not None and len(names) > 1:
                raise ValueError(
                    f"quantization={method.name!r} was chosen for platform {platform.name!r}; "
                    f"device_map={device_map!r} also runs layers on "
                    f"{', '.join(n for n in names if n != platform.name)}, which is not supported "
                    "with quantized weights yet (use quantization='none')"
                )
        self.source = source  # read again on waking from sleep level 2
        self.driver_runner = runner = ModelRunner(
            platform,
            ops,
            arch,
            dtype,
            segments=segments,
            max_model_len=max_model_len,
            vision=vision_inputs_on(config.model),
            experts=experts,
            residual_dtype=config.model.residual_dtype,
        )
        runner.load_weights(source.weights(), prepare=config.cache.cpu_offload_gb <= 0)
        self.num_blocks = runner.determine_num_blocks(config.cache, config.scheduler, max_model_len)
        runner.allocate_kv_cache(self.num_blocks, config.cache.block_size)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        return self.driver_runner.execute(out, block_ids)

    def sleep(self, level: int, transfers=None) -> None:
        if transfers:
            self.driver_runner.run_kv_transfers(transfers)
        self.driver_runner.sleep(level, self.source.weights() if level == 1 else None)

    def wake_up(self) -> None:
        self.driver_runner.wake_up(self.source.weights)


def create_executor(
    config: EngineConfig,
    platform: Platform,
    ops: OpRegistry,
    arch: ArchConfig,
    dtype: torch.dtype,
    source,
    max_model_len: int,
) -> Executor:
    """The executor ``config.parallel`` asks for (None: "uni" for one rank, else "mp")."""
    par = config.parallel
    config.validate()  # e.g. 'uni' with several ranks, a device map with several ranks
    backend = par.distributed_executor_backend or ("uni" if par.world_size == 1 else "mp")
    if backend == "uni":
        return UniProcExecutor(config, platform, ops, arch, dtype, source, max_model_len)
    if backend == "mp":
        from pagedserve.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, platform, source)
    if backend == "ray":
        from pagedserve.distributed.ray_executor import RayExecutor

        return RayExecutor(config, platform, source)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; got {backend!r}")
