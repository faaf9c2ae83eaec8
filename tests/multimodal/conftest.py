"""Fixtures: a tiny random LLaVA checkpoint with its processor (pagedserve.testing.tiny_vlm)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    from pagedserve.testing.tiny_vlm import build_llava

    folder = tmp_path_factory.mktemp("llava")
    model = build_llava(folder)
    return folder, model
