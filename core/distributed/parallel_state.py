"""Process groups of one engine and the collectives the model calls.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``.  Rank 0 is the driver (it runs the
scheduler and the sampler).  All groups live in torch.distributed; this module only
keeps handles to them in a ``ParallelContext`` that is passed explicitly to the model
and the runner (no module-level state).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ParallelContext", "DistInit", "init_distributed", "destroy_distributed", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistInit:
    """How every rank of one engine finds the others (picklable; sent to workers)."""

    master_addr: str
    master_port: int
    world_size: int
    tp_size: int
    pp_size: int
    backend: str
    timeout_s: float
    #: Nodes the ranks are spread over (pagedserve.distributed.multinode); ranks
    #: [r * k, (r + 1) * k) run on node r, k = world_size // nnodes.
    nnodes: int = 1


@dataclass
class ParallelContext:
    """One rank's view of the tensor- and pipeline-parallel groups.

    ``tp_group`` is None when ``tp_size == 1`` (no collective is issued then);
    ``cpu_group`` is a gloo group over all ranks used for Python objects (the per-step
    broadcast), which NCCL cannot carry.
    """

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    #: Multi-node: the rendezvous store (rank 0 hosts it; nodes' heartbeats live there).
    store: dist.Store | None = None

    @classmethod
    def single(cls, device: torch.device) -> ParallelContext:
        return cls(rank=0, world_size=1, tp_size=1, pp_size=1, device=device)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_peer(self, pp_rank: int) -> int:
        """Global rank of this rank's tensor-parallel twin in pipeline stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this pipeline stage owns (an even split)."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size={self.pp_size} exceeds the model's {num_layers} layers")
        return self.pp_rank * num_layers // self.pp_size, (self.pp_rank + 1) * num_layers // self.pp_size

    # -- tensor-parallel collectives ------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the tensor-parallel ranks' ``t`` along ``dim`` (same shapes on all)."""
        if self.tp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    # -- control plane ------------------------------------------------------------------------
    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled over the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_distributed(init: DistInit, rank: int, device: torch.device) -> ParallelContext:
    """Join the engine's process group as ``rank`` and build the subgroups.

    Every rank must call this (``new_group`` is collective); a missing rank makes the
    rendezvous fail after ``init.timeout_s`` instead of hanging.
    """
    timeout = timedelta(seconds=init.timeout_s)
    store = None
    if init.nnodes > 1:
        # Our own store, so that a node that never joins is named (not a bare timeout).
        from pagedserve.distributed.rendezvous import join_rendezvous

        store = join_rendezvous(init, rank)
        dist.init_process_group(init.backend, store=store, rank=rank, world_size=init.world_size, timeout=timeout)
    else:
        dist.init_process_group(
            init.backend,
            init_method=f"tcp://{init.master_addr}:{init.master_port}",
            rank=rank,
            world_size=init.world_size,
            timeout=timeout,
        )
    tp, pp = init.tp_size, init.pp_size
    tp_group = None
    if tp > 1:
        if pp == 1:
            tp_group = dist.group.WORLD
        else:
            for stage in range(pp):
                group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
                if stage == rank // tp:
                    tp_group = group
    # NCCL cannot carry pickled objects from CPU memory: a gloo twin of WORLD does.
    cpu_group = dist.group.WORLD if init.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(
        rank=rank,
        world_size=init.world_size,
        tp_size=tp,
        pp_size=pp,
        device=device,
        tp_group=tp_group,
        cpu_group=cpu_group,
        store=store,
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
