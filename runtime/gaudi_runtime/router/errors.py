"""HTTP errors in TGI's shape: `{"error": message, "error_type": kind}`.

422 validation, 424 generation, 429 overloaded, 503 unhealthy, 401 authentication.
"""

from __future__ import annotations

import json

from aiohttp import web

from gaudi_runtime.router.types import GenerationError, OverloadedError


class ValidationError(ValueError):
    """The request is invalid (HTTP 422, error_type "validation")."""


class ModelNotFoundError(ValidationError):
    """A /v1 request's `model` is neither the base model nor a served adapter: HTTP 404 in OpenAI's
    shape (`openai_not_found`), counted as a validation error."""

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class UnhealthyError(Exception):
    """The engine cannot serve now (HTTP 503, error_type "unhealthy")."""


STATUS = {
    "validation": 422,
    "generation": 424,
    "overloaded": 429,
    "unhealthy": 503,
    "authentication": 401,
    "incomplete_generation": 500,
}


def error_type(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "validation"
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, UnhealthyError):
        return "unhealthy"
    if isinstance(exc, GenerationError):
        return "generation"
    return "incomplete_generation"


def error_body(exc: BaseException) -> dict:
    return {"error": str(exc) or type(exc).__name__, "error_type": error_type(exc)}


def openai_not_found(exc: ModelNotFoundError) -> web.Response:
    body = {"error": {"message": str(exc), "type": "invalid_request_error", "param": "model",
                      "code": "model_not_found"}}
    return web.json_response(body, status=404)


def error_response(exc: BaseException) -> web.Response:
    body = error_body(exc)
    return web.json_response(body, status=STATUS[body["error_type"]])


def json_error(status: int, message: str, kind: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message, "error_type": kind}),
                        content_type="application/json")
