"""pagedserve: a high-throughput, memory-efficient LLM inference and serving engine.

from pagedserve import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
