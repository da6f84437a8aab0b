"""OpenAI's error contract for every `/v1/*` route, in the envelope vLLM sends:
`{"error": {"message", "type", "param", "code"}}`.

Frameworks branch on it: the `openai` client picks its exception class by the status, LiteLLM maps a
message saying "maximum context length" to `ContextWindowExceededError`, LangChain maps the code
`context_length_exceeded` to its context-overflow error. `type` is vLLM's (the class name of the
error: BadRequestError, NotFoundError, ...); `code` is OpenAI's (a string or null, as OpenAI's own
schema has it, where vLLM repeats the status as a number). TGI's routes keep TGI's shape (`errors`).

Pure: no I/O beyond building the aiohttp response.
"""

from __future__ import annotations

from aiohttp import web

from gaudi_runtime.router.errors import (
    ContextLengthError,
    ModelNotFoundError,
    UnhealthyError,
    ValidationError,
    error_body,
    error_response,
    json_error,
)
from gaudi_runtime.router.openai_envelope import applies, body
from gaudi_runtime.router.types import GenerationError, OverloadedError


def response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(body(status, message, param=param, code=code), status=status)


def status_of(exc: BaseException) -> int:
    if isinstance(exc, OpenAIRequestError):
        return exc.status
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, ValidationError):
        return 400
    if isinstance(exc, OverloadedError):
        return 429
    if isinstance(exc, UnhealthyError):
        return 503
    return 500  # a failed generation (TGI's 424) or a failure of the server's own


def exception_body(exc: BaseException) -> dict:
    """The envelope of a request's error (also the event that ends a stream which failed part-way)."""
    status = status_of(exc)
    if isinstance(exc, OpenAIRequestError):
        return body(status, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ContextLengthError):
        # The `openai` client (3.x) puts only the message in the exception's text, where LangChain looks
        # for the code: the message ends with it.
        return body(status, f"{exc.openai_message} (context_length_exceeded)", code="context_length_exceeded")
    if isinstance(exc, ModelNotFoundError):
        return body(status, str(exc), param="model", code="model_not_found")
    message = str(exc) or type(exc).__name__
    if isinstance(exc, GenerationError):
        message = f"the generation failed: {message}"
    return body(status, message)


def exception_response(exc: BaseException) -> web.Response:
    return web.json_response(exception_body(exc), status=status_of(exc))


# --- either shape, by the route ------------------------------------------------------------------

def error_body_for(path: str, exc: BaseException) -> dict:
    """The route's error body: OpenAI's on /v1, TGI's elsewhere."""
    return exception_body(exc) if applies(path) else error_body(exc)


def error_response_for(path: str, exc: BaseException) -> web.Response:
    return exception_response(exc) if applies(path) else error_response(exc)


def json_error_for(path: str, status: int, message: str, kind: str) -> web.Response:
    """An error answered before or around the handler (401, 413, 503, 500, unknown paths), in the
    route's shape; `kind` is TGI's error_type."""
    if applies(path):
        return response(status, message, code="invalid_api_key" if kind == "authentication" else None)
    return json_error(status, message, kind)


class OpenAIRequestError(ValidationError):
    """A /v1 request refused with its own status, `param` and OpenAI `code` (e.g. the 404 of a stored
    response that is not there); counted as a validation error."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
