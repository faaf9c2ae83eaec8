"""pagedserve: a high-throughput, memory-efficient LLM inference and serving engine.

from pagedserve import LLM, SamplingParams
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The OpenMP runtime loaded with torch reads its wait policy once, when torch is first
# imported, so the default is set here, before anything imports torch.  With the
# runtime's own default every pool thread spins for milliseconds after each parallel
# region; on a machine whose cores other processes also want, that spinning takes the
# cores from the threads doing the work, and throughput fell 3-10x with five times the
# CPU time (docs/kernels_cpu.md, "Threads").  A value the user set is kept.
#: Whether this import chose the OpenMP wait policy (False: the user's, or too late).
OMP_WAIT_POLICY_SET = (
    "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
)
if OMP_WAIT_POLICY_SET:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LLMEngine",
    "EngineConfig",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "__version__",
]

# Lazy attributes keep `import pagedserve` (and so `pagedserve platforms`) light.
_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "LLMEngine": "pagedserve.engine",
    "EngineConfig": "pagedserve.config",
    "PoolingParams": "pagedserve.pooling",
    "EmbeddingRequestOutput": "pagedserve.pooling",
}

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.pooling import EmbeddingRequestOutput, PoolingParams
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
