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

__all__ = ["install_openapi"]

_REF = "#/components/schemas/{model}"

# Fields typed `Any` in the models because their check lives in code: their real shape.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_FIELD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "prompt"): {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
    ("ChatMessage", "content"): {"anyOf": [
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
}

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model or route",
           "413": "Body too large", "415": "Body is not JSON", "500": "The engine failed on this request",
           "503": "Queue full, engine unavailable or shutting down"}


def _error_responses() -> dict[str, Any]:
    ref = {"$ref": _REF.format(model="ErrorResponse")}
    return {code: {"description": text, "content": {"application/json": {"schema": ref}}}
            for code, text in _ERRORS.items()}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` document `bodies` (POST path -> request model)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in bodies.values()], ref_template=_REF)
        components = defs.get("$defs", {})
        for (model, name), field_schema in _FIELD_SCHEMAS.items():
            if model in components and name in components[model].get("properties", {}):
                components[model]["properties"][name] = {**field_schema, "title": name.title()}
        components["ErrorResponse"] = _ERROR_SCHEMA
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        for path, model in bodies.items():
            op = schema["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            op.setdefault("responses", {}).update(_error_responses())
            op["responses"]["200"] = {"description": "A completion object, or server-sent events with "
                                                     "`stream: true`",
                                      "content": {"application/json": {"schema": {"type": "object"}},
                                                  "text/event-stream": {"schema": {"type": "string"}}}}
        for path, item in schema["paths"].items():
            for op in item.values():
                op.setdefault("responses", {}).update(
                    {k: v for k, v in _error_responses().items() if k in ("401", "404") and path.startswith("/v1")})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
