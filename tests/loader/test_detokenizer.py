"""Streaming detokenization: deltas must add up to a full decode, even mid-character."""

from __future__ import annotations

import random

import pytest

from pagedserve.loader import IncrementalDetokenizer, Tokenizer

MULTIBYTE_TEXTS = [
    "Emoji 🎉🚀👩‍👩‍👧‍👦 in a row",
    "中文文本，日本語のテキスト，한국어",
    "Mixed: café ∑ 🇫🇷 naïve",
]


def _stream(
    tokenizer: Tokenizer, prompt: list[int], ids: list[int], skip: bool, chunk: int = 1
) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detokenizer.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    assert detokenizer.output_token_ids == ids
    return deltas, detokenizer.text


def test_multibyte_characters_are_held_until_complete(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    deltas, text = _stream(default_tokenizer, [], ids, skip=True)
    assert text == "🎉"
    assert all(d in ("", "🎉") for d in deltas)
    assert "\ufffd" not in text


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_decode_on_text(default_tokenizer: Tokenizer, skip: bool) -> None:
    prompt = default_tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for text in MULTIBYTE_TEXTS:
        ids = default_tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        for chunk in (1, 3):
            deltas, streamed = _stream(default_tokenizer, prompt, ids, skip, chunk)
            assert streamed == default_tokenizer.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in d for d in deltas)
    assert streamed.endswith("<|im_end|>") != skip


def test_deltas_concatenate_to_decode_on_random_ids(default_tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    # Byte tokens that start or continue multi-byte characters, mixed with ordinary tokens.
    pieces = [default_tokenizer.encode(t, add_special_tokens=False) for t in MULTIBYTE_TEXTS]
    pool = sorted({i for p in pieces for i in p})
    prompts = [default_tokenizer.encode(t) for t in ["", "Hi", "<|im_start|>assistant\n", "日本"]]
    for _ in range(100):
        ids = [
            rng.choice(pool) if rng.random() < 0.6 else rng.randrange(default_tokenizer.vocab_size)
            for _ in range(rng.randrange(1, 60))
        ]
        # Prompts end on a character boundary, as real (text) prompts do; random ids then hold
        # stray UTF-8 bytes that must come out as U+FFFD exactly where a full decode puts them.
        prompt = rng.choice(prompts)
        skip = rng.random() < 0.5
        deltas, streamed = _stream(default_tokenizer, prompt, ids, skip, chunk=rng.choice((1, 1, 2)))
        assert streamed == default_tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_window_stays_small(default_tokenizer: Tokenizer) -> None:
    """Each step decodes only a few tokens, not the whole sequence."""
    decoded_lengths: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[override]
            ids = list(ids)
            decoded_lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(default_tokenizer.backend, default_tokenizer.special_tokens)
    ids = default_tokenizer.encode(" ".join(["word"] * 300), add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(counting, list(range(100, 150)))
    for i in ids:
        detokenizer.step([i])
    assert detokenizer.text == default_tokenizer.decode(ids)
    assert max(decoded_lengths) <= 8


def test_flush_emits_a_trailing_incomplete_character(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("ok 🎉", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(default_tokenizer, [])
    text = "".join(detokenizer.step([i]) for i in ids[:-1])
    assert text in ("ok", "ok ")  # the emoji's first bytes (with or without the space) are held back
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd") and detokenizer.text == default_tokenizer.decode(ids[:-1])
