"""Fixtures of the chaos suite (helpers in chaos_helpers.py).

The CI versions are small; the full sizes are marked `slow` (`make chaos` runs both).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chaos_helpers import ENGINE, InProcessServer

from pagedserve import LLM


@pytest.fixture
def inproc_server(tiny_llama) -> Iterator[InProcessServer]:
    server = InProcessServer(str(tiny_llama))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def offline(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama), dtype=ENGINE["dtype"], kv_cache_memory=ENGINE["kv_cache_memory"])
