"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Messages are written for users: never a stack trace, a file path or a memory address.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """Raised by handlers; rendered by the app's exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_error(message: str) -> APIError:
    return APIError(500, message, "engine_error", None, "engine_error")


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, code)
