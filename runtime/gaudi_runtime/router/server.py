"""The router's aiohttp application: API key, CORS, error bodies, and the routes of `routes`.

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

from gaudi_runtime.config import Config
from gaudi_runtime.router.errors import UnhealthyError, ValidationError, error_response, json_error
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.routes import add_routes
from gaudi_runtime.router.state import STATE, AppState
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import Engine, GenerationError, OverloadedError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
METRICS = web.AppKey("gaudi_serve_metrics", Metrics)
MAX_BODY = 8 * 1024 * 1024


def _cors_origin(config: Config, origin: str | None) -> str | None:
    allowed = config.cors_allow_origin
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def _cors_headers(config: Config, request: web.Request) -> dict[str, str]:
    origin = _cors_origin(config, request.headers.get("Origin"))
    if origin is None:
        return {}
    h = {"Access-Control-Allow-Origin": origin,
         "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
         "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                             "Content-Type, Authorization")}
    if origin != "*":
        h["Vary"] = "Origin"
    return h


def _middlewares(config: Config) -> list:
    @web.middleware
    async def cors(request: web.Request, handler):
        if request.method == "OPTIONS" and config.cors_allow_origin:
            return web.Response(status=204, headers=_cors_headers(config, request))
        return await handler(request)

    @web.middleware
    async def api_key(request: web.Request, handler):
        if config.api_key and request.path not in OPEN_PATHS:
            auth = request.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     config.api_key.encode()):
                return json_error(401, "Unauthorized: a valid `Authorization: Bearer <api key>` header is required",
                                  "authentication")
        return await handler(request)

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except (ValidationError, OverloadedError, GenerationError, UnhealthyError) as e:
            return error_response(e)
        except web.HTTPRequestEntityTooLarge as e:
            return json_error(413, str(e), "validation")
        except web.HTTPException:
            raise
        except Exception as e:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return json_error(500, f"internal error: {type(e).__name__}: {e}", "internal")

    return [cors, api_key, errors]


def build_app(config: Config, engine: Engine, tokenizer: RouterTokenizer,
              metrics: Metrics | None = None, images=None) -> web.Application:
    """The HTTP application; pass `metrics` to share it with the engine (else one is made:
    `app[METRICS]` or `get_metrics(app)`)."""
    metrics = metrics or Metrics()
    app = web.Application(middlewares=_middlewares(config), client_max_size=MAX_BODY)
    app[STATE] = AppState(config=config, engine=engine, tokenizer=tokenizer, metrics=metrics, images=images)
    app[METRICS] = metrics

    if config.cors_allow_origin:
        async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
            for k, v in _cors_headers(config, request).items():
                response.headers.setdefault(k, v)

        app.on_response_prepare.append(add_cors)

    add_routes(app)
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
