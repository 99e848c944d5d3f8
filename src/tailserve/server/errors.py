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


# The body every error answer carries, as published in /openapi.json.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


def document_400_for_validation(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's generated schema declares 422 with its own body for invalid requests; this
    server answers those with 400 and an OpenAI error body (``_validation`` in app.py), so
    the published schema says that instead. Modifies and returns ``schema``."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {
                    "description": "Invalid request",
                    "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                    }},
                }
    # Only the 422 answers referred to FastAPI's validation bodies.
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ERROR_SCHEMA
    return schema


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_error(message: str) -> APIError:
    return APIError(500, message, "engine_error", None, "engine_error")


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, code)
