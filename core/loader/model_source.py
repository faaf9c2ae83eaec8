"""`open_model`: one entry point over both checkpoint formats.

    source = open_model(None)            # the bundled SmolLM2-135M-Instruct GGUF
    source.hf_config["num_hidden_layers"]
    for name, tensor in source.weights(): ...
    tokenizer = source.tokenizer()
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.loader.gguf_checkpoint import GGUFCheckpoint
from pagedserve.loader.hf_checkpoint import (
    find_safetensors_files,
    iter_safetensors_weights,
    normalize_hf_config,
    read_eos_token_ids,
    read_json,
)
from pagedserve.loader.model_path import resolve_model_path
from pagedserve.loader.tokenizer import Tokenizer

__all__ = ["ModelSource", "open_model"]


class ModelSource:
    """A checkpoint on disk, opened: its config, weights and tokenizer.

    Attributes:
        path: the checkpoint folder (`format == "hf"`) or `.gguf` file (`format == "gguf"`).
        format: "hf" or "gguf".
        hf_config: `config.json` semantics (see `normalize_hf_config`), built from GGUF
            metadata for GGUF files.
        eos_token_ids: every id that ends generation.
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._tokenizer: Tokenizer | None = None
        if path.is_file():
            self.format = "gguf"
            self._gguf: GGUFCheckpoint | None = GGUFCheckpoint(path)
            self._files: list[pathlib.Path] = []
            self.hf_config: dict[str, Any] = self._gguf.hf_config()
            self.eos_token_ids: list[int] = self._gguf.eos_token_ids()
        else:
            self.format = "hf"
            self._gguf = None
            self._files = find_safetensors_files(path)
            self.hf_config = normalize_hf_config(read_json(path / "config.json"), self._weight_names())
            self.eos_token_ids = read_eos_token_ids(path, self.hf_config)

    def _weight_names(self) -> set[str]:
        from safetensors import safe_open

        names: set[str] = set()
        for file in self._files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        return names

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_parameter_name, tensor)` for every stored parameter, one at a time.

        safetensors tensors keep their stored dtype; GGUF tensors are dequantized to float32.
        `lm_head.weight` is absent when the checkpoint ties it to the embeddings.
        """
        if self._gguf is not None:
            return self._gguf.weights()
        return iter_safetensors_weights(self._files)

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (built once, then shared)."""
        if self._tokenizer is None:
            if self._gguf is not None:
                self._tokenizer = Tokenizer.from_gguf_metadata(self._gguf.metadata)
            else:
                self._tokenizer = Tokenizer.from_folder(self.path, self.hf_config)
        return self._tokenizer

    def __repr__(self) -> str:
        architectures = self.hf_config.get("architectures")
        return f"ModelSource(path={str(self.path)!r}, format={self.format!r}, architectures={architectures})"


def open_model(model: str | pathlib.Path | None) -> ModelSource:
    """Open the checkpoint `model` names (see `resolve_model_path` for what it may be)."""
    return ModelSource(resolve_model_path(model))
