"""Model loading: checkpoint paths, configs, weights (safetensors and GGUF) and tokenizers.

from pagedserve.loader import open_model, IncrementalDetokenizer

source = open_model(None)  # the default model, SmolLM2-135M-Instruct (GGUF)
config = source.hf_config
state = dict(source.weights())
tokenizer = source.tokenizer()
"""

from pagedserve.loader.detokenizer import IncrementalDetokenizer
from pagedserve.loader.errors import ModelLoadError
from pagedserve.loader.model_path import DEFAULT_MODEL_ALIAS, resolve_model_path
from pagedserve.loader.model_source import ModelSource, open_model
from pagedserve.loader.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "IncrementalDetokenizer",
    "ModelLoadError",
    "ModelSource",
    "Tokenizer",
    "open_model",
    "resolve_model_path",
]
