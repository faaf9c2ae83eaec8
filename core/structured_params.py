"""StructuredOutputsParams: the constraint a request's output must follow (vLLM's names),
and the names of the grammar backends and reasoning formats (settings check them here,
below the engine that implements them).

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and
``structural_tag`` is set.  The grammar itself is built and compiled by the engine
(pagedserve.structured_output.backend); this class only checks the shape of the request.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "StructuredOutputsParams",
    "BACKENDS",
    "REASONING_PARSERS",
    "parse_structured_outputs_config",
    "structured_outputs_fields",
]

#: Backends ``structured_outputs_config.backend`` may name ("auto" picks xgrammar).
BACKENDS = ("auto", "xgrammar")

#: Reasoning formats: name -> (start marker, end marker).
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint.

    json: a JSON schema (dict or its JSON text); regex: a regular expression the whole
    output matches; choice: the output is exactly one of these strings; grammar: an
    EBNF/GBNF grammar whose ``root`` rule the output matches; json_object: any JSON
    object; structural_tag: xgrammar's structural-tag JSON (free text, with the parts
    between a trigger's begin and end constrained by a schema).
    disable_any_whitespace: JSON without optional whitespace (compact).
    disable_additional_properties: objects in a schema without ``additionalProperties``
    get no extra keys (as if it said false).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {', '.join(set_kinds) or 'none'}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                "(use disable_any_whitespace for compact JSON)"
            )
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            self.structural_tag = _json.dumps(self.structural_tag)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object, structural_tag."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable description of the grammar: requests with equal keys share a compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        spec = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        return kind, flags + spec


_CONFIG_KEYS = ("backend", "reasoning_parser")


def parse_structured_outputs_config(text: str) -> dict[str, Any] | str:
    """``--structured-outputs-config``: a JSON object with ``backend`` and/or
    ``reasoning_parser``, or a bare backend name; ValueError naming the problem otherwise."""
    if text in BACKENDS:
        return text
    try:
        value = _json.loads(text)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
    if not isinstance(value, dict) or set(value) - set(_CONFIG_KEYS):
        raise ValueError(
            f"--structured-outputs-config must be a JSON object with {' and/or '.join(_CONFIG_KEYS)}; got {text!r}"
        )
    if value.get("backend", "auto") not in BACKENDS:
        raise ValueError(
            f"--structured-outputs-config backend must be one of {', '.join(BACKENDS)}; got {value['backend']!r}"
        )
    if value.get("reasoning_parser") not in (None, *REASONING_PARSERS):
        raise ValueError(
            f"--structured-outputs-config reasoning_parser must be one of "
            f"{', '.join(REASONING_PARSERS)}; got {value['reasoning_parser']!r}"
        )
    return value


def structured_outputs_fields(value: Any, reasoning_parser: str | None) -> tuple[Any, str | None]:
    """(backend, reasoning_parser) of ``structured_outputs_config`` given as a backend name,
    a dict (the flag's JSON) or a StructuredOutputsConfig; an explicit ``reasoning_parser``
    wins over the one inside ``value``."""
    if value is None:
        return "auto", reasoning_parser
    if isinstance(value, str):
        return value, reasoning_parser
    if isinstance(value, dict):
        unknown = set(value) - set(_CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has no setting {', '.join(map(repr, sorted(unknown)))}; "
                f"it takes {' and '.join(_CONFIG_KEYS)}"
            )
        fields = value
    elif all(hasattr(value, k) for k in _CONFIG_KEYS):  # a StructuredOutputsConfig
        fields = {k: getattr(value, k) for k in _CONFIG_KEYS}
    else:
        raise ValueError(
            f"structured_outputs_config must be a dict, a StructuredOutputsConfig or a backend name; got {value!r}"
        )
    inner = fields.get("reasoning_parser")
    return fields.get("backend", "auto"), reasoning_parser if reasoning_parser is not None else inner
