"""Tensor and pipeline parallelism: process groups, workers and multi-process executors.

Collectives are torch.distributed with the platform's ``dist_backend`` (gloo on CPU,
NCCL on GPUs); placement across machines is Ray's.  Heavy modules (workers, executors,
Ray) are imported on use, so importing the model code stays cheap.
"""

from pagedserve.distributed.parallel_state import DistInit, ParallelContext, init_distributed

__all__ = ["DistInit", "ParallelContext", "init_distributed"]
