"""HTTP errors in TGI's shape: `{"error": message, "error_type": kind}` (the /v1 routes answer
OpenAI's instead: `openai_errors`).

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
    shape (`openai_errors`) on every route, counted as a validation error."""

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class ContextLengthError(ValidationError):
    """The prompt, or the prompt with the tokens asked for, does not fit the model's limits: TGI's
    message on TGI's routes, `openai_message` (worded as vLLM words it) on /v1."""

    def __init__(self, message: str, openai_message: str):
        super().__init__(message)
        self.openai_message = openai_message


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


def error_response(exc: BaseException) -> web.Response:
    body = error_body(exc)
    return web.json_response(body, status=STATUS[body["error_type"]])


def json_error(status: int, message: str, kind: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message, "error_type": kind}),
                        content_type="application/json")
