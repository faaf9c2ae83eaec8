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

from pagedserve.loader.errors import ModelLoadError
from pagedserve.loader.gguf_checkpoint import GGUFCheckpoint
from pagedserve.loader.hf_checkpoint import (
    find_safetensors_files,
    iter_safetensors_weights,
    normalize_hf_config,
    read_eos_token_ids,
    read_json,
)
from pagedserve.loader.model_path import resolve_model_path
from pagedserve.loader.text_part import text_part, text_weight_name
from pagedserve.loader.tokenizer import Tokenizer
from pagedserve.loader.validation import check_config, check_tensor_shapes

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
        try:
            self._open(path)
        except ModelLoadError:
            raise
        except FileNotFoundError:
            raise  # no checkpoint there at all: not a corrupt one
        except Exception as e:  # noqa: BLE001 - any parse failure of a corrupt file becomes one named error
            raise ModelLoadError(path, _describe(e)) from e

    def _open(self, path: pathlib.Path) -> None:
        if path.is_file():
            self.format = "gguf"
            self._text_prefix: str | None = None
            self._gguf: GGUFCheckpoint | None = GGUFCheckpoint(path)
            self._files: list[pathlib.Path] = []
            self.hf_config: dict[str, Any] = self._gguf.hf_config()
            self.eos_token_ids: list[int] = self._gguf.eos_token_ids()
            shapes = self._gguf.tensor_shapes()
        else:
            self.format = "hf"
            self._gguf = None
            self._files = find_safetensors_files(path)
            shapes = self._weight_shapes()
            config = read_json(path / "config.json")
            # A multimodal wrapper's text decoder (loader/text_part.py): its config and tensors.
            part = text_part(config)
            self._text_prefix = None
            if part is not None:
                config, self._text_prefix = part
                renamed = {n: text_weight_name(n, self._text_prefix) for n in shapes}
                shapes = {new: shapes[old] for old, new in renamed.items() if new is not None}
            self.hf_config = normalize_hf_config(config, set(shapes))
            self.eos_token_ids = read_eos_token_ids(path, self.hf_config)
        # Values no model can have, or that the tensors contradict, fail here by name rather
        # than as an arithmetic error, a huge allocation or garbage output later.
        check_config(self.hf_config, path)
        check_tensor_shapes(self.hf_config, shapes, path)

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for file in self._files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        shapes[name] = tuple(f.get_slice(name).get_shape())
            except Exception as e:  # noqa: BLE001 - SafetensorError does not name the file
                raise ModelLoadError(file, _describe(e)) from e
        return shapes

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_parameter_name, tensor)` for every stored parameter, one at a time.

        safetensors tensors keep their stored dtype; GGUF tensors are dequantized to float32.
        `lm_head.weight` is absent when the checkpoint ties it to the embeddings.
        """
        if self._gguf is not None:
            return _named_errors(self._gguf.weights(), self.path)
        weights = iter_safetensors_weights(self._files)
        if self._text_prefix is not None:
            prefix = self._text_prefix
            weights = ((new, t) for name, t in weights if (new := text_weight_name(name, prefix)) is not None)
        return _named_errors(weights, self.path)

    def tensor(self, name: str) -> torch.Tensor | None:
        """One stored tensor by name (e.g. a sequence-classification ``score.weight``),
        or None when the checkpoint has none (GGUF files: always None)."""
        from safetensors import safe_open

        for file in self._files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if name in f.keys():
                    return f.get_tensor(name)
        return None

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (built once, then shared)."""
        if self._tokenizer is None:
            try:
                if self._gguf is not None:
                    self._tokenizer = Tokenizer.from_gguf_metadata(self._gguf.metadata)
                else:
                    self._tokenizer = Tokenizer.from_folder(self.path, self.hf_config)
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
                where = self.path if self._gguf is not None else self.path / "tokenizer.json"
                raise ModelLoadError(where, f"the tokenizer cannot be built: {_describe(e)}") from e
        return self._tokenizer

    def __repr__(self) -> str:
        architectures = self.hf_config.get("architectures")
        return f"ModelSource(path={str(self.path)!r}, format={self.format!r}, architectures={architectures})"


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def _named_errors(
    weights: Iterator[tuple[str, torch.Tensor]], path: pathlib.Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, with a read failure (a file truncated since it was opened) named."""
    try:
        yield from weights
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError and numpy errors do not name the file
        raise ModelLoadError(path, f"reading the weights failed: {_describe(e)}") from e


def open_model(model: str | pathlib.Path | None) -> ModelSource:
    """Open the checkpoint `model` names (see `resolve_model_path` for what it may be)."""
    return ModelSource(resolve_model_path(model))
