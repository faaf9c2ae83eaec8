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


@pytest.fixture(scope="session")
def qwen_vl_dir(tmp_path_factory):
    from pagedserve.testing.tiny_vlm import build_qwen2_5_vl

    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    model = build_qwen2_5_vl(folder)
    return folder, model


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    from pagedserve.testing.tiny_vlm import build_qwen3_vl

    folder = tmp_path_factory.mktemp("qwen3_vl")
    model = build_qwen3_vl(folder)
    return folder, model
