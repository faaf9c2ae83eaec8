"""Streaming detokenization: text deltas as generated ids arrive.

Decoding the whole sequence after every token is O(n) per step. Instead, as vLLM does, only a
short window is decoded: `ids[prefix_offset:read_offset]` is text already emitted (kept as
context because a token's text can depend on its left neighbour, e.g. SentencePiece spaces
or a UTF-8 character split over byte tokens) and `ids[read_offset:]` is new. The delta is
what the window adds beyond the context. A delta ending in U+FFFD is an incomplete UTF-8
character and is held back until the bytes that complete it arrive.
"""

from __future__ import annotations

from pagedserve.loader.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens kept as left context for the first generated token.
_INITIAL_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, one step at a time.

    For byte-level BPE vocabularies (the default model's) the deltas concatenate to exactly
    `tokenizer.decode(generated_ids)`. For SentencePiece vocabularies the first token keeps
    its leading space, as the continuation of the prompt (the prompt is the context).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - _INITIAL_CONTEXT, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def step(self, new_token_ids: list[int]) -> str:
        """Append `new_token_ids` and return the text they complete ("" while it is pending)."""
        self.token_ids.extend(new_token_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """At the end of a request: emit text still held back (an incomplete character as U+FFFD)."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        context = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if len(window) <= len(context) or (hold_incomplete and window.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = window[len(context) :]
        # The emitted tokens become the next window's context; older tokens drop out of it.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)
