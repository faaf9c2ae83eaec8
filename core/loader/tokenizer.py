"""The engine's tokenizer: a `tokenizers.Tokenizer` plus special tokens and a chat template.

It is built either from a checkpoint folder's `tokenizer.json` / `tokenizer_config.json`
or from a GGUF file's metadata, and encodes to the same ids as transformers' AutoTokenizer
on the same files.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from pagedserve.loader.chat_template import render_chat_template
from pagedserve.loader.gguf_tokenizer import build_gguf_tokenizer
from pagedserve.loader.hf_checkpoint import read_json

__all__ = ["Tokenizer"]

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids for one model.

    Attributes:
        vocab_size: ids in use, added tokens included.
        bos_token_id / eos_token_id: None when the model has none.
        all_special_ids: ids of every special token (skipped by `decode` by default).
        chat_template: Jinja2 source, or None.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        named = {self._id_of(t) for t in self.special_tokens.values()}
        self.all_special_ids: set[int] = special | {i for i in named if i is not None}

    @classmethod
    def from_folder(cls, folder: pathlib.Path, config: dict[str, Any] | None = None) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint folder (needs `tokenizer.json`).

        BOS/EOS insertion is whatever `tokenizer.json`'s post-processor does, as with
        transformers' generic fast tokenizer (`add_bos_token` in the config does not override it).

        `config` (the model's `config.json`) supplies BOS/EOS ids that `tokenizer_config.json`
        does not name.
        """
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(folder)!r} has no tokenizer.json; only fast-tokenizer files are supported (save "
                "one with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder))."
            )
        backend = BackendTokenizer.from_file(str(path))
        settings_file = folder / "tokenizer_config.json"
        settings = read_json(settings_file) if settings_file.is_file() else {}
        specials = {name: _token_content(settings.get(name)) for name in _NAMED_SPECIALS}
        for name in ("bos_token", "eos_token", "pad_token"):
            token_id = (config or {}).get(f"{name}_id")
            if specials[name] is None and isinstance(token_id, int):
                specials[name] = backend.id_to_token(token_id)
        return cls(backend, specials, _folder_chat_template(folder, settings))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata."""
        backend = build_gguf_tokenizer(metadata)
        tokens = metadata["tokenizer.ggml.tokens"]
        specials = {}
        for name, key in zip(_NAMED_SPECIALS, ("bos", "eos", "unknown", "padding")):
            token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
            specials[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
        return cls(backend, specials, metadata.get("tokenizer.chat_template"))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the model's BOS/EOS if it uses them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Token strings as the vocabulary spells them (byte-level `Ġ` etc. left as is)."""
        tokens = []
        for i in ids:
            token = self.backend.id_to_token(int(i))
            if token is None:
                raise ValueError(f"Token id {i} is outside the vocabulary (size {self.vocab_size}).")
            tokens.append(token)
        return tokens

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers would render it.

        Args:
            messages: `[{"role": "user", "content": "..."}, ...]`.
            add_generation_prompt: end with the opening of the assistant's turn.
            chat_template: overrides the model's template.
            **kwargs: extra template variables (e.g. `tools`).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "This model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "GGUF metadata); pass chat_template=... or use a plain completion prompt."
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _folder_chat_template(folder: pathlib.Path, settings: dict[str, Any]) -> str | None:
    """The default chat template: `chat_template.jinja` wins over `tokenizer_config.json`."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is what a plain chat uses.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
