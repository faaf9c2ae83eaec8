"""The request fields that constrain output: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` aliases, turned into StructuredOutputsParams.

Each problem is an ApiError(400) naming the field; the grammar is built here too (it is
tokenizer-independent and quick) so a bad schema, regex or grammar never reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.structured_output import StructuredOutputsParams, build_grammar

__all__ = ["structured_outputs_of", "checked_params", "OPENAPI_FIELD_SCHEMAS"]

_SO_FIELDS = {f.name for f in fields(StructuredOutputsParams)}
_NULL = {"type": "null"}
_STR = {"anyOf": [_NULL, {"type": "string"}]}
#: The request fields of structured outputs and tools as /openapi.json documents them:
#: what the code checks, no more (anything outside is a 400; values inside may still be a
#: 400, e.g. a schema xgrammar cannot build).
OPENAPI_FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "response_format": {
        "anyOf": [
            _NULL,
            {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"type": "string", "enum": ["text", "json_object", "json_schema", "structural_tag"]}
                },
            },
        ]
    },
    "structured_outputs": {"anyOf": [_NULL, {"type": "object"}]},
    "guided_json": {"anyOf": [_NULL, {"type": "object"}, {"type": "string"}, {"type": "boolean"}]},
    "guided_regex": _STR,
    "guided_choice": {"anyOf": [_NULL, {"type": "array", "items": {"type": "string"}}]},
    "guided_grammar": _STR,
    "guided_decoding_backend": {"anyOf": [_NULL, {"type": "string", "enum": ["auto", "xgrammar"]}]},
    "guided_whitespace_pattern": _NULL,  # refused
    "tools": {
        "anyOf": [
            _NULL,
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {"type": {"enum": ["function"]}},
                },
            },
        ]
    },
    "tool_choice": {
        "anyOf": [
            _NULL,
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"]},
        ]
    },
}

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def checked_params(spec: dict[str, Any], param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec) with its grammar built; ApiError(400) naming `param`."""
    unknown = sorted(set(spec) - _SO_FIELDS)
    if unknown:
        raise ApiError(
            400,
            f"'{param}' has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_SO_FIELDS))}.",
            param=param,
        )
    try:
        so = StructuredOutputsParams(**spec)
        build_grammar(so)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"Invalid '{param}': {e}", param=param) from None
    return so


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(400, "'response_format' must be an object with a 'type'.", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return checked_params({"json_object": True}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ApiError(
                400,
                "'response_format.json_schema' must be an object with a 'schema' object.",
                param="response_format.json_schema",
            )
        # OpenAI allows a missing schema (any JSON object); strict only narrows what it accepts.
        schema = js.get("schema")
        spec = {"json": schema} if schema is not None else {"json_object": True}
        return checked_params(spec, "response_format.json_schema")
    if kind == "structural_tag":
        rest = {k: v for k, v in rf.items() if k != "type"}
        tag = rest.get("format", rest) if "format" in rest else {"type": "structural_tag", **rest}
        return checked_params({"structural_tag": json.dumps(tag)}, "response_format")
    raise ApiError(
        400,
        f"'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}.",
        param="response_format.type",
    )


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The constraint a completions or chat request asks for (at most one source of it)."""
    found: list[tuple[str, StructuredOutputsParams | None]] = []
    rf = getattr(request, "response_format", None)
    if rf is not None:
        so = _from_response_format(rf)
        if so is not None:
            found.append(("response_format", so))
    if request.structured_outputs is not None:
        if not isinstance(request.structured_outputs, dict):
            raise ApiError(400, "'structured_outputs' must be an object.", param="structured_outputs")
        found.append(("structured_outputs", checked_params(request.structured_outputs, "structured_outputs")))
    if request.guided_whitespace_pattern is not None:
        raise ApiError(
            400,
            "'guided_whitespace_pattern' is not supported by this server (for compact JSON use "
            "structured_outputs.disable_any_whitespace).",
            param="guided_whitespace_pattern",
        )
    for name, key in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, checked_params({key: value}, name)))
    backend = request.guided_decoding_backend
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise ApiError(
            400,
            f"'guided_decoding_backend' {backend!r} is not available; this server uses xgrammar.",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ApiError(400, f"Only one output constraint may be given; got {names}.", param=found[1][0])
    if found and getattr(request, "use_beam_search", False):
        raise ApiError(400, f"'{found[0][0]}' cannot be combined with 'use_beam_search'.", param=found[0][0])
    return found[0][1] if found else None
