"""Serving over several engines: data-parallel replicas behind a router, and
disaggregated prefill/decode.

These modules start and drive whole engines (``LLM``, ``AsyncLLMEngine``), so they sit
above the engine; tensor and pipeline parallelism inside one engine is
:mod:`pagedserve.distributed`, below it.  Nothing is imported here, so that importing
this package stays cheap: import the submodule you need.
"""

__all__: list[str] = []
