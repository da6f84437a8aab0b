"""The route table: every path the router serves, its handler and the request model of its body.

The table is the one place that knows both APIs, so SageMaker's /invocations, which takes either
API's body, lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

from gaudi_runtime.router import openai_api, tgi_api
from gaudi_runtime.router.http_common import read_body, recorder
from gaudi_runtime.router.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TokenizeRequest,
)


async def handle_invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's route: a chat body, a completions body, or a TGI body (streamed or not by its `stream`)."""
    rec = recorder(request)
    body = await read_body(request, rec)
    if "messages" in body:
        return await openai_api.run_chat(request, body, rec)
    if "prompt" in body and "inputs" not in body:
        return await openai_api.run_completions(request, body, rec)
    return await tgi_api.compat_generate(request, body, rec)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: object
    bodies: tuple[type[BaseModel], ...] = ()  # the request models its body may be


ROUTES = (
    Route("POST", "/generate", tgi_api.handle_generate, (GenerateRequest,)),
    Route("POST", "/generate_stream", tgi_api.handle_generate_stream, (GenerateRequest,)),
    Route("POST", "/", tgi_api.handle_compat, (GenerateRequest,)),
    Route("POST", "/invocations", handle_invocations, (ChatCompletionRequest, CompletionRequest, GenerateRequest)),
    Route("POST", "/tokenize", tgi_api.handle_tokenize, (TokenizeRequest,)),
    Route("POST", "/v1/completions", openai_api.handle_completions, (CompletionRequest,)),
    Route("POST", "/v1/chat/completions", openai_api.handle_chat, (ChatCompletionRequest,)),
    Route("GET", "/info", tgi_api.handle_info),
    Route("GET", "/health", tgi_api.handle_health),
    Route("GET", "/ping", tgi_api.handle_ping),
    Route("GET", "/metrics", tgi_api.handle_metrics),
    Route("GET", "/v1/models", openai_api.handle_models),
)


def add_routes(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, route.path, route.handler)
