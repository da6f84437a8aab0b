"""OpenAI's error envelope, `{"error": {"message", "type", "param", "code"}}`, and which paths answer in it:
pure (no aiohttp), so that the launcher's start-up port (start_http.py) answers /v1 as the router will."""

from __future__ import annotations

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
         413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
         503: "ServiceUnavailableError"}
PREFIX = "/v1/"


def applies(path: str) -> bool:
    """Whether a route answers errors in OpenAI's shape (the /v1 routes) rather than TGI's."""
    return path.startswith(PREFIX)


def body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "BadRequestError" if status < 500 else
                                                            "InternalServerError"),
                      "param": param, "code": code}}
