"""StructuredOutputsParams: the constraint a request's output must follow (vLLM's names).

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and
``structural_tag`` is set.  The grammar itself is built and compiled by the engine
(pagedserve.structured_output.backend); this class only checks the shape of the request.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams"]

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
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag; got {', '.join(set_kinds) or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                             "(use disable_any_whitespace for compact JSON)")
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
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
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
