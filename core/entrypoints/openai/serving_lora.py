"""LoRA adapters over HTTP: a request's `model` may name an adapter, /v1/models lists
them (``parent``: the base model) and, with --allow-runtime-lora-updating,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them (vLLM's bodies).

The adapter a request's `model` names is remembered in a context variable by
``OpenAIServing.model_name`` and read by ``OpenAIServing.submit`` of the same request
(so completions, chat and beam search all pass it on without new arguments).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pagedserve.engine.client import EngineClient
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.lora import LoRARequest
from pagedserve.lora.registry import LoRAModules

__all__ = ["LoRAServing", "REQUEST_LORA", "add_lora_routes", "lora_serving"]

#: The adapter the current request's `model` named (None: the base model).
REQUEST_LORA: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar("request_lora", default=None)


class LoRAServing:
    """The served adapters of one server (None of this without --enable-lora)."""

    def __init__(self, engine: Any, modules: list[tuple[str, str]], allow_runtime_updates: bool) -> None:
        self.engine = engine
        self.modules = LoRAModules()
        self.allow_runtime_updates = allow_runtime_updates
        for name, path in modules:
            self.modules.add(name, path)

    def check_all(self) -> None:
        """Load every startup adapter once (ValueError naming the first bad one)."""
        for lora in self.modules.all():
            self._check(lora.lora_path)

    def _check(self, path: str) -> None:
        self.engine.check_lora_adapter(path)

    def resolve(self, model: str) -> LoRARequest | None:
        return self.modules.get(model)

    def cards(self, base_card: dict, base_name: str) -> list[dict]:
        return [
            {**base_card, "id": lora.lora_name, "root": lora.lora_path, "parent": base_name}
            for lora in self.modules.all()
        ]

    async def load(self, body: dict) -> str:
        name, path = _name_path(body, need_path=True)
        if self.modules.get(name) is not None:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            await asyncio.to_thread(self._check, path)
        except ValueError as exc:
            status = 404 if "is not a directory" in str(exc) else 400
            raise ApiError(status, str(exc), param="lora_path", code="not_found" if status == 404 else None) from None
        try:
            self.modules.add(name, path)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> str:
        name, _ = _name_path(body, need_path=False)
        if self.modules.remove(name) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."


def lora_serving(engine: EngineClient, modules, allow_runtime_updates: bool) -> LoRAServing | None:
    """The server's adapters when its engine has enable_lora, else None (adapter names
    are then unknown models)."""
    if not engine.lora_enabled:
        return None
    return LoRAServing(engine, list(modules), allow_runtime_updates)


def _name_path(body: Any, need_path: bool) -> tuple[str, str | None]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'lora_name' must be a non-empty string.", param="lora_name")
    if need_path and (not isinstance(path, str) or not path):
        raise ApiError(400, "'lora_path' must be a non-empty string.", param="lora_path")
    return name, path


def add_lora_routes(app: FastAPI, lora: LoRAServing | None, read_body) -> None:
    """The runtime load/unload routes: 403 unless --allow-runtime-lora-updating."""

    async def body_of(request: Request) -> dict:
        if lora is None or not lora.allow_runtime_updates:
            raise ApiError(
                403,
                "Runtime LoRA updates are disabled: start the server with --enable-lora --allow-runtime-lora-updating.",
                code="forbidden",
            )
        try:
            return json.loads(await read_body(request) or b"null")
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"The request body is not valid JSON: {exc}") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        return PlainTextResponse(await lora.load(await body_of(request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        return PlainTextResponse(lora.unload(await body_of(request)))
