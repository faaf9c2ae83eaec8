"""Tiny random Llama checkpoints for end-to-end checks, made on the spot (no download).

The checkpoint is a Hugging Face folder -- ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` -- so the engine loads it through the
same path as a real model.  With transformers installed it is made by transformers'
``LlamaForCausalLM`` (an independent writer of the format); without it, by
:func:`write_llama_safetensors`, which needs only safetensors and tokenizers (both
pagedserve dependencies).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["TinyLlamaSpec", "make_tiny_llama", "write_byte_tokenizer", "write_llama_safetensors"]

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model.

    head_dim 64 is a size every serious attention kernel supports (so native kernels
    run rather than fall back); 2 heads over 1 KV head exercise grouped-query attention.
    """

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer without merges (3 specials + 256 bytes); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        ),
        encoding="utf-8",
    )
    return len(vocab)


def _config(spec: TinyLlamaSpec, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **asdict(spec),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _init_(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Wider-than-default weights spread the logits, so greedy choices are not near-ties
    that a last-bit difference between two correct kernels could flip."""
    if p.dim() == 2:
        p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
    else:  # norm weights: around 1, but not all equal
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def write_llama_safetensors(path: Path, vocab_size: int, spec: TinyLlamaSpec, seed: int = 0) -> None:
    """Write ``config.json`` and ``model.safetensors`` with Hugging Face Llama names."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "mlp.gate_proj.weight": (inter, h),
            pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (vocab_size, h)}
    tensors = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.float32)
        _init_(name, t, gen)
        tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_config(spec, vocab_size), indent=2), encoding="utf-8")


def _write_with_transformers(path: Path, vocab_size: int, spec: TinyLlamaSpec, seed: int) -> None:
    import transformers

    cfg = {
        k: v for k, v in _config(spec, vocab_size).items() if k not in ("architectures", "model_type", "torch_dtype")
    }
    # fork_rng: transformers initialises from the global generator; do not disturb the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _init_(name, p, gen)
    # A progress bar for one tiny shard is noise in a check report.
    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    finally:
        if bars:
            logging.enable_progress_bar()


def make_tiny_llama(path: str | Path, spec: TinyLlamaSpec | None = None, seed: int = 0, writer: str = "auto") -> Path:
    """Create a tiny random Llama checkpoint folder at ``path`` and return it.

    writer: "transformers", "safetensors" (pagedserve's own writer) or "auto"
    (transformers when it is installed).
    """
    if writer not in ("auto", "transformers", "safetensors"):
        raise ValueError(f"writer must be 'auto', 'transformers' or 'safetensors', got {writer!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = spec or TinyLlamaSpec()
    vocab = write_byte_tokenizer(path)
    if writer == "auto":
        writer = "transformers" if importlib.util.find_spec("transformers") is not None else "safetensors"
    if writer == "transformers":
        _write_with_transformers(path, vocab, spec, seed)
    else:
        write_llama_safetensors(path, vocab, spec, seed)
    return path
