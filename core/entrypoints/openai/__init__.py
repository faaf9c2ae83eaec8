"""The OpenAI-compatible HTTP server: request models, serving logic, metrics, the app."""

from __future__ import annotations

from pagedserve.entrypoints.openai.api_server import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
