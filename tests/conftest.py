"""Shared fixtures: tiny random Hugging Face checkpoints made with transformers, and the native CPU kernels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from native_build import native_build_failed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer without merges (256 byte tokens + specials).

    Returns its vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return len(vocab)


def make_tiny_checkpoint(
    path: Path,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    max_position_embeddings: int = 1024,
    **extra,
) -> Path:
    """Save a random Llama or Qwen2 checkpoint (safetensors) plus a tokenizer to ``path``."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        **extra,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(arch)
    # Larger-than-default init spreads the logits so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name else 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(**kwargs) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), **kwargs)
        return cache[key]

    return make


#: Configuration keys that say where and how a transformers model's weights were stored
#: (the GGUF file's name and block types), not what the model is.
_PROVENANCE_KEYS = ("_name_or_path", "transformers_version", "quantization_config")


def _config_dict(model) -> dict:
    d = model.config.to_dict()
    for key in _PROVENANCE_KEYS:
        d.pop(key, None)
    return d


@pytest.fixture(scope="session")
def default_model_hf_dir(tmp_path_factory) -> Path:
    """transformers' float32 reading of the default model's GGUF file, saved as safetensors
    once per session: the reference of every default-model test.

    Reading the GGUF file dequantizes each tensor in Python (15-40 s on 2 cores; it was done
    once per test file); the saved copy loads in a second or two.  It is checked here to
    hold exactly the tensors (bit for bit, same dtypes) and configuration that transformers
    read from the GGUF file, so a test loading it compares against the same reference.
    Load it with ``AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)``:
    each test gets its own model object, free to modify (peft, a bf16 copy).
    """
    import copy

    import transformers
    from safetensors.torch import save_model

    from pagedserve.loader.model_path import default_model_path

    gguf = default_model_path()
    auto = transformers.AutoModelForCausalLM
    read = auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("default-model-hf")
    # A plain float32 checkpoint (save_pretrained refuses a model read from GGUF): the
    # tensors as transformers dequantized them, the configuration without the GGUF origin.
    save_model(read, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(read.config)
    del config.quantization_config
    config.save_pretrained(folder)
    again = auto.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert getattr(again, "hf_quantizer", None) is None
    want, got = read.state_dict(), again.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert _config_dict(again) == _config_dict(read)
    assert type(again) is type(read)
    return folder


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    """transformers' tokenizer for the default GGUF, built by transformers from the same file
    (5-10 s on 2 cores: shared by the session; no test may modify it)."""
    from transformers import AutoTokenizer

    from pagedserve.loader.model_path import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The native CPU kernels, built on first use; a failed build fails the test (skips
    only where PAGEDSERVE_NO_COMPILER=1, see tests/native_build.py)."""
    from pagedserve.kernels import build
    from pagedserve.kernels.cpu import load_cpu_kernels

    try:
        build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return load_cpu_kernels()


@pytest.fixture(scope="module")
def every_isa():
    """The native CPU kernels bound to each instruction set this build and CPU can run
    (attention tests run each input through all of them, the reference computed once)."""
    from pagedserve.kernels import build
    from pagedserve.kernels.cpu import load_cpu_kernels
    from tests.kernels.test_cpu_kernels import runnable_isas

    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return {isa: load_cpu_kernels(isa=isa) for isa in runnable_isas(mod)}
