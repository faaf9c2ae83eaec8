"""Executor: the interface the engine runs steps through, whatever runs them.

Kept apart from the implementations so that the multi-rank executors of
:mod:`pagedserve.distributed` can subclass it without importing the module that
chooses among them (:mod:`pagedserve.executor.executor`), which imports them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.executor.model_runner import ModelRunner, StepOutput
from pagedserve.scheduler import SchedulerOutput

__all__ = ["Executor"]


class Executor(ABC):
    """Runs scheduled steps on one rank or many.

    ``driver_runner`` is rank 0's ModelRunner (it owns the sampler); ``num_blocks`` is the
    number of KV blocks every rank agreed on.
    """

    driver_runner: ModelRunner
    num_blocks: int
    #: Rank 0's shard of a draft model sharded like the target (draft_tensor_parallel_size).
    draft_runner: ModelRunner | None = None

    @abstractmethod
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        """Run one scheduled step on every rank; sampled tokens come from rank 0."""

    def forward_logits(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]], num_logits: list[int], draft: bool = False
    ) -> torch.Tensor:
        """Run one scheduled step's forward on every rank; on rank 0, the logits of the
        last ``num_logits[i]`` tokens of each scheduled request in batch order
        (``[sum(num_logits), vocab]``, any float dtype, on rank 0's device): speculative
        decoding verifies drafts with them.  ``draft``: run the draft model sharded over
        the ranks (``draft_runner``) instead of the target."""
        if draft:
            raise ValueError("this executor holds no sharded draft model")
        return self.driver_runner.forward_logits(out, block_ids, num_logits)

    def sleep(self, level: int, transfers=None) -> None:
        """Sleep mode: every rank drops its weights (level 1 keeping a host copy) and its
        KV cache; ``transfers``: the host tier's pending copies, run first."""
        raise ValueError(f"{type(self).__name__} cannot sleep")

    def wake_up(self) -> None:
        """Every rank reloads its weights (from the host copy, else the checkpoint) and
        allocates an empty KV cache."""
        raise ValueError(f"{type(self).__name__} cannot sleep")

    def check_health(self) -> None:  # noqa: B027 (optional hook: one process has nothing to check)
        """Raise RuntimeError if a worker is gone."""

    def shutdown(self) -> None:  # noqa: B027 (optional hook: one process has nothing to stop)
        """Stop workers and release the process group; safe to call twice."""
