"""The engine's tokenizer when ``ModelConfig.tokenizer`` names one other than the model's."""

from __future__ import annotations

import pathlib

from pagedserve.loader.model_source import ModelSource, open_model
from pagedserve.loader.tokenizer import Tokenizer

__all__ = ["load_tokenizer", "engine_tokenizer"]


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer at ``name``: a folder with tokenizer.json (config.json optional), a
    .gguf file, a checkpoint folder, or the default model's alias."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file() and not (path / "config.json").is_file():
        return Tokenizer.from_folder(path)
    return open_model(name).tokenizer()


def engine_tokenizer(model_config, source: ModelSource, vocab_size: int) -> Tokenizer:
    """``model_config.tokenizer``'s tokenizer, else the model's own.

    ValueError when the named tokenizer cannot be read or produces ids the model's
    embedding (``vocab_size`` rows) does not have.
    """
    if model_config.tokenizer is None:
        return source.tokenizer()
    try:
        tok = load_tokenizer(model_config.tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer={model_config.tokenizer!r}: {e}") from None
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer={model_config.tokenizer!r} has {tok.vocab_size} tokens, more than the "
            f"model's vocabulary ({vocab_size}); it does not belong to this model"
        )
    return tok
