"""The router's aiohttp application: CORS, body size, API key, readiness, error bodies, and the
routes of `routes`.

    app = build_app(config, engine, tokenizer, metrics=metrics)
    runner = web.AppRunner(app, handler_cancellation=True)   # see `start`

`handler_cancellation=True` makes aiohttp cancel a handler whose client went away,
which closes the engine's iterator (and so frees the request) even for
non-streaming requests; streaming handlers also notice it on their next write.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from gaudi_runtime.config import Config, ServerConfig
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.drain import DRAIN, Drain
from gaudi_runtime.router.errors import (
    ModelNotFoundError,
    UnhealthyError,
    ValidationError,
)
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.openai_envelope import applies as openai_route
from gaudi_runtime.router.openai_errors import error_response_for, exception_response, json_error_for
from gaudi_runtime.router.reasoning import thinking_tokens
from gaudi_runtime.router.routes import add_routes, open_route
from gaudi_runtime.router.state import STATE, AppState
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import Engine, GenerationError, OverloadedError

log = logging.getLogger(__name__)

METRICS = web.AppKey("gaudi_serve_metrics", Metrics)


def _cors_origin(server: ServerConfig, origin: str | None) -> str | None:
    allowed = server.cors_allow_origin
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def _cors_headers(server: ServerConfig, request: web.Request) -> dict[str, str]:
    origin = _cors_origin(server, request.headers.get("Origin"))
    if origin is None:
        return {}
    h = {"Access-Control-Allow-Origin": origin,
         "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
         "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                             "Content-Type, Authorization")}
    if origin != "*":
        h["Vary"] = "Origin"
    return h


def too_large(server: ServerConfig, size: int | None = None, path: str = "") -> web.Response:
    given = f"{size} bytes, " if size is not None else ""
    return json_error_for(path, 413, f"Request body too large: {given}more than --max-request-bytes "
                           f"({server.max_request_bytes})", "validation")


def authorized(server: ServerConfig, request: web.Request) -> bool:
    """The request carries the API key (compared in constant time), or none is set."""
    if not server.api_key:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), server.api_key.encode())


def not_ready(health: dict, path: str = "") -> web.Response:
    """The one answer of every route but the open ones until the server can serve: TGI's error
    body, with the warmup's progress while it warms up (OpenAI's on /v1)."""
    status = health.get("status", "unhealthy") if isinstance(health, dict) else "unhealthy"
    message = f"the server cannot serve requests yet ({status})"
    if openai_route(path):
        return json_error_for(path, 503, message, "unhealthy")
    body = {"error": message, "error_type": "unhealthy"}
    if isinstance(health, dict) and health.get("warmup") is not None:
        body["warmup"] = health["warmup"]
    return web.json_response(body, status=503)


def _middlewares(server: ServerConfig, engine: Engine) -> list:
    @web.middleware
    async def cors(request: web.Request, handler):
        if request.method == "OPTIONS" and server.cors_allow_origin:
            return web.Response(status=204, headers=_cors_headers(server, request))
        return await handler(request)

    @web.middleware
    async def gate(request: web.Request, handler):
        """Body size first (before anything reads it), then the API key, then readiness."""
        if request.content_length is not None and request.content_length > server.max_request_bytes:
            return too_large(server, request.content_length, request.path)
        if open_route(request):
            return await handler(request)
        if not authorized(server, request):
            return json_error_for(request.path, 401, "Unauthorized: a valid `Authorization: Bearer <api key>` "
                                                     "header is required", "authentication")
        ready, health = engine.health()
        return await handler(request) if ready else not_ready(health, request.path)

    return [cors, gate, _errors(server)]


def _errors(server: ServerConfig):
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except ModelNotFoundError as e:
            return exception_response(e)  # OpenAI's 404, /invocations included
        except (ValidationError, OverloadedError, GenerationError, UnhealthyError) as e:
            return error_response_for(request.path, e)
        except web.HTTPRequestEntityTooLarge:
            return too_large(server, path=request.path)
        except web.HTTPException as e:
            if e.status >= 400 and openai_route(request.path):  # an unknown /v1 path or method
                return json_error_for(request.path, e.status, e.reason, "validation")
            raise
        except Exception as e:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return json_error_for(request.path, 500, f"internal error: {type(e).__name__}: {e}", "internal")

    return errors


def build_app(config: Config, engine: Engine, tokenizer: RouterTokenizer,
              metrics: Metrics | None = None, images=None) -> web.Application:
    """The HTTP application; pass `metrics` to share it with the engine (else one is made:
    `app[METRICS]` or `get_metrics(app)`)."""
    metrics = metrics or Metrics(config.model.model_name)
    drain = Drain()  # admission during a graceful shutdown (router/drain.py)
    app = web.Application(middlewares=[drain.middleware, *_middlewares(config.server, engine)],
                          client_max_size=config.server.max_request_bytes)
    # The engine's adapter table, which its requests are numbered by; a stand-in engine (tests) has none.
    adapters = getattr(engine, "adapters", None) or AdapterTable(config.adapters, config.model)
    app[STATE] = AppState(config=config, engine=engine, tokenizer=tokenizer, metrics=metrics, images=images,
                          adapters=adapters, thinking=thinking_tokens(config.structured_output.reasoning_parser,
                                                                      _encoder(tokenizer)))
    app[METRICS] = metrics
    app[DRAIN] = drain

    if config.server.cors_allow_origin:
        async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
            for k, v in _cors_headers(config.server, request).items():
                response.headers.setdefault(k, v)

        app.on_response_prepare.append(add_cors)

    add_routes(app, config.adapters.allow_runtime_lora_updating)
    return app


def get_metrics(app: web.Application) -> Metrics:
    return app[METRICS]


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = any free port); return the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = runner.addresses
    bound = sockets[0][1] if sockets else port
    return runner, bound


def _encoder(tokenizer: RouterTokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
