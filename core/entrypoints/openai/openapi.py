"""The server's OpenAPI document (`/openapi.json`, browsable at `/docs`).

The generation routes read their bodies themselves (strict parsing, OpenAI's error
shape), so FastAPI cannot see their request models; this module puts the pydantic models
of `protocol.py` into the document as the routes' request bodies, and documents the
error responses every route may give.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedserve.entrypoints.openai.protocol import MAX_N
from pagedserve.entrypoints.openai.request_fields import MAX_TEMPERATURE
from pagedserve.entrypoints.openai.structured import OPENAPI_FIELD_SCHEMAS

__all__ = ["install_openapi"]

_REF = "#/components/schemas/{model}"

# Fields typed `Any` in the models because their check lives in code: their real shape.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_FIELD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "prompt"): {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]
    },
    ("EmbeddingRequest", "input"): {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]
    },
    ("ChatMessage", "content"): {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                },
            },
        ]
    },
    ("ChatCompletionRequest", "messages"): {
        "type": "array",
        "items": {"$ref": "#/components/schemas/ChatMessage"},
        "minItems": 1,
    },
}

# length_penalty other than 1 needs use_beam_search: true (serving_beam.check_beam_fields).
_BEAM_RULE = {
    "anyOf": [
        {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}},
        {"properties": {"length_penalty": {"const": 1.0}}},
    ]
}
# Rules between fields that protocol.py checks in code, as schema keywords of the model.
_MODEL_RULES: dict[str, dict[str, Any]] = {
    # Only assistant and tool turns may leave their content out (or null).
    "ChatMessage": {
        "anyOf": [
            {"properties": {"role": {"enum": ["assistant", "tool"]}}},
            {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        ]
    },
    "CompletionRequest": _BEAM_RULE,
    "ChatCompletionRequest": _BEAM_RULE,
}

# Ranges checked in code (SamplingParams, protocol.py): documented, and what a schema-based
# client or fuzzer generates.  Each applies to the field's non-null form.
_RANGES: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "n": {"minimum": 1, "maximum": MAX_N},
    "best_of": {"minimum": 1, "maximum": MAX_N},  # and at least n, checked in code
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 10},
    "min_tokens": {"minimum": 0},
    "top_logprobs": {"minimum": 0, "maximum": 20},
}


def _constrain(props: dict[str, Any], models: list[str]) -> None:
    """Put the ranges, the structured-output and tool fields' shapes and the served model names
    into one request model's properties."""
    for name, prop in props.items():
        if name in OPENAPI_FIELD_SCHEMAS:  # structured outputs and tools: their real shapes
            props[name] = {**OPENAPI_FIELD_SCHEMAS[name], "title": prop.get("title", name)}
        elif name in _RANGES:
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") in ("integer", "number"):
                    branch.update(_RANGES[name])
    if "model" in props:
        # "" and null both mean the first served model.
        props["model"] = {"anyOf": [{"type": "string", "enum": [*models, ""]}, {"type": "null"}], "title": "Model"}
    if "logprobs" in props and "top_logprobs" not in props:  # completions: an integer 0-20
        for branch in props["logprobs"].get("anyOf", [props["logprobs"]]):
            if branch.get("type") == "integer":
                branch.update({"minimum": 0, "maximum": 20})


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model or route",
    "413": "Body too large",
    "415": "Body is not JSON",
    "500": "The engine failed on this request",
    "503": "Queue full, engine unavailable or shutting down",
}


def _error_responses() -> dict[str, Any]:
    ref = {"$ref": _REF.format(model="ErrorResponse")}
    return {
        code: {"description": text, "content": {"application/json": {"schema": ref}}} for code, text in _ERRORS.items()
    }


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]], models: list[str]) -> None:
    """Make `app.openapi()` document `bodies` (POST path -> request model); `models` are
    the served model names."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in bodies.values()], ref_template=_REF)
        components = defs.get("$defs", {})
        for (model, name), field_schema in _FIELD_SCHEMAS.items():
            if model in components and name in components[model].get("properties", {}):
                components[model]["properties"][name] = {**field_schema, "title": name.title()}
        for model in bodies.values():
            _constrain(components[model.__name__]["properties"], models)
        for model, rules in _MODEL_RULES.items():
            if model in components:
                components[model].update(rules)
        # Optional in the models only to word their errors; the server requires them.
        for model, name in (("CompletionRequest", "prompt"), ("EmbeddingRequest", "input")):
            if model in components:
                components[model]["required"] = [name]
        components["ErrorResponse"] = _ERROR_SCHEMA
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        for path, model in bodies.items():
            op = schema["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
            }
            op.setdefault("responses", {}).update(_error_responses())
            op["responses"]["200"] = {
                "description": "A completion object, or server-sent events with `stream: true`",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            }
        for path, item in schema["paths"].items():
            for op in item.values():
                op.setdefault("responses", {}).update(
                    {k: v for k, v in _error_responses().items() if k in ("401", "404") and path.startswith("/v1")}
                )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
