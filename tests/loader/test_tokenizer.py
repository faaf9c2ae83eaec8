"""Tokenizers against transformers' AutoTokenizer on the same files, and chat templates."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from pagedserve.loader import Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    " leading space and  double  spaces ",
    "Tabs\tand\nnewlines\r\n\n\nend",
    "Unicode: café, naïve, Ærøskøbing, Straße, İstanbul",
    "CJK: 你好，世界。日本語のテキスト。한국어 텍스트",
    "Emoji: 🎉🚀 👩‍👩‍👧‍👦 🏳️‍🌈 and flags 🇫🇷",
    "Math: ∑_{i=1}^{n} x² ≤ ∞ → ∀ε>0",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n",
    'json = {"key": [1, 2.5e-3, null], "s": "x\\"y"}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "Numbers 1234567890 and 3.14159 and 1,000,000",
    "Contractions: don't, I'm, we'll, they've, she'd, it's",
    "   ",
    "Zero\u200bwidth and \u00a0nbsp and combining e\u0301",
    "مرحبا بالعالم — Привет, мир!",
]


def test_encode_matches_transformers(default_tokenizer: Tokenizer, hf_default_tokenizer: Any) -> None:
    for text in TEXTS:
        for add_special in (True, False):
            expected = hf_default_tokenizer.encode(text, add_special_tokens=add_special)
            assert default_tokenizer.encode(text, add_special_tokens=add_special) == expected, text


def test_chat_markers_are_single_special_tokens(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert default_tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert {0, 1, 2} <= default_tokenizer.all_special_ids
    assert default_tokenizer.bos_token_id == 1 and default_tokenizer.eos_token_id == 2
    assert default_tokenizer.vocab_size == 49152


def test_decode_matches_transformers(default_tokenizer: Tokenizer, hf_default_tokenizer: Any) -> None:
    rng = random.Random(0)
    sequences = [hf_default_tokenizer.encode(text) for text in TEXTS]
    for _ in range(50):
        sequences.append([rng.randrange(default_tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))])
    for ids in sequences:
        for skip in (True, False):
            expected = hf_default_tokenizer.decode(ids, skip_special_tokens=skip)
            assert default_tokenizer.decode(ids, skip_special_tokens=skip) == expected, ids
        assert default_tokenizer.convert_ids_to_tokens(ids) == hf_default_tokenizer.convert_ids_to_tokens(ids)


def test_roundtrip_and_skip_special(default_tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert default_tokenizer.decode(default_tokenizer.encode(text), skip_special_tokens=False) == text
    assert default_tokenizer.decode(default_tokenizer.encode("<|im_start|>hi<|im_end|>")) == "hi"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of France?"}],
    [
        {"role": "user", "content": "Write a haiku about 🌸."},
        {"role": "assistant", "content": "Petals drift\nsoftly"},
        {"role": "user", "content": "Another, in 日本語"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    default_tokenizer: Tokenizer, hf_default_tokenizer: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = hf_default_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ours = default_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ours == expected
    # The last conversation has no system message, so the template supplies SmolLM's default.
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_joins_content_parts(default_tokenizer: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    plain = [{"role": "user", "content": "one\ntwo"}]
    assert default_tokenizer.apply_chat_template(parts) == default_tokenizer.apply_chat_template(plain)
    with pytest.raises(ValueError, match="image_url"):
        image = {"type": "image_url", "image_url": {}}
        default_tokenizer.apply_chat_template([{"role": "user", "content": [image]}])


def test_chat_template_environment(default_tokenizer: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if not messages %}{{ raise_exception('empty') }}{% endif %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}\n"
    )
    messages = [{"role": "user", "content": '<a> & "b"'}]
    out = default_tokenizer.apply_chat_template(messages, chat_template=template)
    assert out == '<|im_start|>"<a> & \\"b\\""<|im_end|>'
    with pytest.raises(ValueError, match="empty"):
        default_tokenizer.apply_chat_template([], chat_template=template)
    with pytest.raises(ValueError):
        # The sandbox refuses attribute access to Python internals.
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{{ messages.__class__.__mro__ }}"
        )


def test_missing_chat_template_is_a_clear_error(default_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(default_tokenizer.backend, default_tokenizer.special_tokens, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_folder_tokenizer_matches_transformers(saved_tokenizer_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(saved_tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(str(saved_tokenizer_dir))
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.chat_template is not None
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


def test_folder_tokenizer_uses_the_post_processor(saved_tokenizer_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A tokenizer.json that adds BOS (as Llama's do) adds it here too, and only when asked."""
    import shutil

    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path / "with_bos"
    shutil.copytree(saved_tokenizer_dir, folder)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|>:0 $A:0", pair="<|im_start|>:0 $A:0 $B:1", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_folder(folder)
    reference = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text)[0] == ours.bos_token_id == 1
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


# A SentencePiece-style ("llama") GGUF vocabulary, made up here: control tokens, 256 byte
# tokens, and pieces scored so that longer pieces merge first.
_WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "token", "izer", "ing", "er", "he", "llo"]


def _sentencepiece_vocab() -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces: dict[str, float] = {}
    for word in _WORDS:
        for text in (word, "▁" + word):
            for i in range(len(text)):
                for j in range(i + 1, len(text) + 1):
                    piece = text[i:j]
                    pieces[piece] = max(pieces.get(piece, -1e9), -float(len(text)) + len(piece) * 0.5)
    for piece, _ in sorted(pieces.items(), key=lambda item: (-item[1], item[0])):
        tokens.append(piece)
        types.append(1)
    scores = [0.0] * 259 + [pieces[t] for t in tokens[259:]]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": (
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
        ),
    }


def test_sentencepiece_gguf_tokenizer_matches_transformers(
    tmp_path: pathlib.Path, write_gguf: Any, tiny_llama: Any
) -> None:
    from transformers import AutoTokenizer

    from pagedserve.loader.gguf_checkpoint import GGUFCheckpoint

    model, config = tiny_llama
    vocab = _sentencepiece_vocab()
    config = {**config, "vocab_size": len(vocab["tokenizer.ggml.tokens"])}
    path = write_gguf(tmp_path / "sp.gguf", "llama", config, {}, {}, metadata=vocab)
    # Tokenizer only: a file without tensors is no loadable model, so skip open_model's checks.
    ours = Tokenizer.from_gguf_metadata(GGUFCheckpoint(path).metadata)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["hello world", "the cat sat on the mat", " hello", "tokenizer", "unknown ü 🎉 bytes", "a</s>b", ""]
    for text in texts:
        expected = reference.encode(text)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True), text
    assert ours.encode("hello")[0] == 1  # SentencePiece vocabularies add BOS by default
    assert ours.decode(ours.encode("hello world")) == "hello world"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>"
