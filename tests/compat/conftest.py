"""The engines of the matrix's equality suites, shared by a module's cells."""

from __future__ import annotations

import json

import pytest
from compat_cases import TINY, Engines

from pagedserve.testing.compat_matrix import TINY_HF_CONFIG


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, tmp_path_factory):
    path = tiny_checkpoint_factory(**TINY)
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in TINY_HF_CONFIG if k not in ("architectures", "model_type")} == {
        k: v for k, v in TINY_HF_CONFIG.items() if k not in ("architectures", "model_type")
    }
    pool = Engines(str(path), tmp_path_factory.mktemp("compat"))
    try:
        yield pool
    finally:
        pool.close()
