"""Building a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges and a type per
token. Two vocabulary kinds are rebuilt here, the same way transformers rebuilds them so
both produce the same ids:

- `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen2) with a ByteLevel pre-tokenizer/decoder.
- `llama`: SentencePiece-style BPE (Llama 2, Mistral) with byte fallback and `▁` for spaces.

Tokens typed CONTROL become special added tokens so `<|im_start|>` is never split.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["build_gguf_tokenizer", "bytes_to_unicode", "template_processor"]

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte.
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letters keep their combining marks (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35).
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` names whose merges were learned on a split other than GPT-2's; every
# other name (including SmolLM2's "smollm") keeps ByteLevel's built-in GPT-2 split.
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "lfm2": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def build_gguf_tokenizer(metadata: dict[str, Any]) -> BackendTokenizer:
    """The tokenizer described by `metadata` (a GGUF file's key/value pairs)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("The GGUF file has no tokenizer.ggml.tokens, so it carries no tokenizer.")
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata)
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)."
        )
    _add_typed_tokens(backend, metadata, byte_level=kind == "gpt2")
    _set_post_processor(backend, metadata, default_add_bos=kind == "llama")
    return backend


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Run a block with the cyclic garbage collector off.

    Building the BPE model allocates ~50k merge tuples; each burst of allocations can trigger
    a full collection, which walks every object torch's import created (~0.2 s here). The
    tuples form no cycles and are freed by reference counting, so nothing is lost.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=1)
def _outside_byte_alphabet() -> re.Pattern[str]:
    """Matches any character that is not one of the 256 byte-level BPE characters."""
    return re.compile(f"[^{re.escape(''.join(bytes_to_unicode().values()))}]")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_bpe(metadata: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    outside = _outside_byte_alphabet()
    if outside.search("".join(tokens)) is None:
        # The usual case, checked with one regex scan instead of one set per token.
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        spelling = bytes_to_unicode()
        # Some converters store a token's raw text instead of its byte spelling.
        vocab = {
            "".join(spelling[b] for b in token.encode("utf-8")) if outside.search(token) else token: index
            for index, token in enumerate(tokens)
        }
    with _gc_paused():
        merges = _file_merges(metadata)
        if merges is None:
            raise ValueError("The GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges.")
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = dict(zip(tokens, range(len(tokens))))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    with _gc_paused():
        merges = _file_merges(metadata)
        if merges is None:
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                raise ValueError("The GGUF SentencePiece tokenizer has neither merges nor scores.")
            merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=tokens[unk_id] if unk_id is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _file_merges(metadata: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = [tuple(merge.split(" ")) for merge in merges]
    # A separate check keeps the split loop a comprehension, which is what makes it fast.
    if any(len(pair) != 2 for pair in pairs):
        bad = next(merge for merge, pair in zip(merges, pairs) if len(pair) != 2)
        raise ValueError(f"GGUF merge {bad!r} is not two tokens separated by one space.")
    return pairs  # type: ignore[return-value]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens, best-scored token first (ties: shorter left, then shorter right part)."""
    candidates: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        splits = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        splits.sort(key=lambda s: (vocab[s[0]], vocab[s[1]]))
        candidates.extend(splits)
    candidates.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_typed_tokens(backend: BackendTokenizer, metadata: dict[str, Any], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a
    converter mislabel; adding it would grow the vocabulary past the model's, so it is skipped.
    """
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    tokens = metadata["tokenizer.ggml.tokens"]
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    # The model's own vocabulary, asked token by token: copying all of it out is slower.
    model = backend.model
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and model.token_to_id(token) is not None
    ]
    if user_defined:
        backend.add_tokens(user_defined)


def _set_post_processor(backend: BackendTokenizer, metadata: dict[str, Any], default_add_bos: bool) -> None:
    """Add BOS/EOS around encoded text as the file's `add_bos_token`/`add_eos_token` say."""
    tokens = metadata["tokenizer.ggml.tokens"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    backend.post_processor = template_processor(
        (tokens[bos_id], bos_id) if add_bos else None, (tokens[eos_id], eos_id) if add_eos else None
    )


def template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """A post-processor wrapping each sequence in the given `(token, id)` BOS and/or EOS."""
    prefix = f"{bos[0]}:0 " if bos else ""
    suffix = f" {eos[0]}:0" if eos else ""
    single = f"{prefix}$A:0{suffix}"
    pair = f"{single} {prefix.replace(':0', ':1')}$B:1{suffix.replace(':0', ':1')}"
    specials = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
