"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status."""

from __future__ import annotations

import json

__all__ = ["ApiError", "error_body", "error_json"]

_TYPES = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_server_error",
}


class ApiError(Exception):
    """An error answered to the client; `param` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> bytes:
    return json.dumps(error_body(message, type, param, code)).encode()
