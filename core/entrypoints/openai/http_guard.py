"""Cross-site request protection: JSON-only bodies and an opt-in CORS policy.

A browser lets any web page send a "simple" cross-origin POST (Content-Type
`text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data`, or none at
all) without asking the server first.  A server that parses such a body as JSON can
therefore be driven by any page its user visits, key or no key on a local machine.  So
JSON routes refuse every other content type with 415: a page must then send
`application/json`, which makes the browser ask first (a CORS preflight), and that is
refused unless the operator listed the page's origin in `--allowed-origins`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from pagedserve.entrypoints.openai.errors import ApiError

__all__ = ["CorsSettings", "add_http_security_arguments", "cors_settings_from_args", "install_cors", "require_json"]


def require_json(request: Request) -> None:
    """ApiError(415) unless the body is declared `application/json` (or `application/*+json`)."""
    raw = request.headers.get("content-type")
    media = (raw or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"'{raw}'" if raw else "none"
    raise ApiError(
        415,
        f"Unsupported Content-Type {got}: this route takes a JSON body; send 'Content-Type: application/json'.",
        code="unsupported_media_type",
    )


@dataclass
class CorsSettings:
    """CORS policy (Starlette's CORSMiddleware); no origins means no CORS headers at all."""

    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def install_cors(app: FastAPI, cors: CorsSettings | None) -> None:
    """Add the CORS middleware when origins are configured."""
    if cors is None or not cors.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )


def parse_list(value: str, flag: str) -> list[str]:
    """A JSON list of strings (vLLM's form) or a comma-separated list."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON list of strings, got {text}")
        return [i.strip() for i in items if i.strip()]
    return [i.strip() for i in text.split(",") if i.strip()]


def add_http_security_arguments(parser: argparse.ArgumentParser) -> None:
    """--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials."""
    g = parser.add_argument_group("cross-origin requests (CORS)")
    g.add_argument(
        "--allowed-origins",
        type=lambda v: parse_list(v, "--allowed-origins"),
        default=[],
        help="origins whose web pages may call this server, as a JSON list or comma list, e.g. "
        '\'["http://localhost:3000"]\' or "*" (default: none)',
    )
    g.add_argument(
        "--allowed-methods",
        type=lambda v: parse_list(v, "--allowed-methods"),
        default=["*"],
        help="HTTP methods allowed cross-origin (default: all; only with --allowed-origins)",
    )
    g.add_argument(
        "--allowed-headers",
        type=lambda v: parse_list(v, "--allowed-headers"),
        default=["*"],
        help="request headers allowed cross-origin (default: all; only with --allowed-origins)",
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let cross-origin pages send cookies and Authorization (only with --allowed-origins)",
    )


def cors_settings_from_args(args: argparse.Namespace) -> CorsSettings:
    if "*" in args.allowed_origins and args.allow_credentials:
        raise ValueError(
            "--allow-credentials cannot be combined with --allowed-origins '*': browsers refuse "
            "credentials for a wildcard origin; list the origins instead"
        )
    return CorsSettings(
        list(args.allowed_origins), list(args.allowed_methods), list(args.allowed_headers), bool(args.allow_credentials)
    )
