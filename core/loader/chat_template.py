"""Rendering Hugging Face chat templates (Jinja2) into a prompt string.

Templates come from checkpoints, i.e. from strangers, so they run in Jinja's immutable
sandbox. The environment matches transformers' (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`) so a
template renders to the same text here as there.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["normalize_messages", "render_chat_template"]


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with `template`.

    Args:
        template: the Jinja2 chat template source.
        messages: `[{"role": ..., "content": ...}, ...]`; list-of-parts content is joined.
        add_generation_prompt: end with the header that opens the assistant's turn.
        special_tokens: `bos_token`, `eos_token`, ... visible to the template.
        **kwargs: further template variables (`tools`, `documents`, custom flags); they
            override `special_tokens` of the same name, as in transformers.
    """
    variables = {
        "tools": None,
        "documents": None,
        **(special_tokens or {}),
        **kwargs,
        "messages": normalize_messages(messages),
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _compile(template).render(**variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"The chat template failed to render: {e}") from e


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` whose `content` is a string.

    OpenAI-style content may be a list of parts; text parts are joined with newlines (as vLLM
    does for text-only models) and any other part is refused.
    """
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"Message {index} must be a dict with a 'role', got {message!r}.")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(_part_text(part, index) for part in content)
        out.append(message)
    return out


def _part_text(part: Any, index: int) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"Message {index} has a content part of type {kind!r}; only text parts are supported.")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"The chat template is not valid Jinja2: {e}") from e
