"""pagedserve: a high-throughput, memory-efficient LLM inference and serving engine.

from pagedserve import LLM, SamplingParams
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The OpenMP runtime loaded with torch (libgomp) reads its settings once, when torch is
# first imported, so the default is set here, before anything imports torch.  Its own
# default spins each pool thread for about 300,000 iterations (milliseconds) after every
# parallel region: on a machine whose cores other processes also want, that spinning
# takes the cores from the threads doing the work (throughput fell 3-10x under load).
# Sleeping at once (OMP_WAIT_POLICY=PASSIVE) cures that but costs a wake-up per region,
# and a decode step has hundreds of regions: on an idle machine batch-1 decode ran at
# 0.61x.  A short spin (3,000 iterations, tens of microseconds) bridges the gaps between
# one step's regions and gives the cores up soon after: 0.96-0.98x libgomp's default when
# idle (docs/kernels_cpu.md, "Threads").  A value the user set is kept.
#: Whether this import chose the OpenMP spin count (False: the user's, or too late).
OMP_WAIT_POLICY_SET = (
    "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
)
if OMP_WAIT_POLICY_SET:
    os.environ["GOMP_SPINCOUNT"] = "3000"


def _unshadow_kernels() -> None:
    """Run from a source checkout (``python -m pagedserve ...`` or ``python -m pytest`` in
    the repository root), the working directory heads sys.path and the source folder
    kernels/ would be found as the top-level package ``kernels``, shadowing the Hugging Face
    ``kernels`` package that transformers (5.25 on) imports as soon as it loads its
    activations, image processors or models, and fails on.  pagedserve reaches that folder
    as ``pagedserve.kernels`` only, so ``kernels`` is bound, lazily (nothing loads until
    first use), to the package found without the checkout's root.  Installed copies of
    pagedserve and checkouts not on sys.path are left alone."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if "kernels" in sys.modules or not os.path.isfile(os.path.join(root, "kernels", "__init__.py")):
        return
    if not any(os.path.realpath(p or os.getcwd()) == root for p in sys.path):
        return
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None or not spec.has_location:  # none, or a namespace package
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


_unshadow_kernels()

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
