"""The route table: every path the router serves, its handler and the request model of its body.

The table is the one place that knows both APIs, so SageMaker's /invocations, which takes either
API's body, lives here too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

import gaudi_runtime
from gaudi_runtime.router import docs_ui, lora_api, openai_api, responses_api, tgi_api
from gaudi_runtime.router import response_models as rm
from gaudi_runtime.router import responses_models as rsp
from gaudi_runtime.router.http_common import read_body, recorder
from gaudi_runtime.router.openapi import openapi_document
from gaudi_runtime.router.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from gaudi_runtime.router.responses_store import RESPONSES, ResponseStore


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
    """One route: its handler, what its body may be, what it answers (for the OpenAPI document),
    and who may call it when."""

    method: str
    path: str
    handler: object
    bodies: tuple[type[BaseModel], ...] = ()  # the request models its body may be
    replies: tuple[type[BaseModel], ...] = ()  # the JSON bodies of its 200
    events: tuple[type[BaseModel], ...] = ()  # the JSON of each server-sent event, when it streams
    media: str | None = None  # the media type of a 200 that is not JSON
    summary: str = ""
    tag: str = "Text Generation Inference"
    generates: bool = False  # runs a generation: 424 and 429 are possible
    done_marker: bool = False  # its streams end with `data: [DONE]` (OpenAI's)
    open: bool = False  # neither the API key nor a ready server is needed: probes and the API's description
    unready: type[BaseModel] | None = None  # an open route's own 503 body
    documented: bool = True  # described by the OpenAPI document
    selects_model: bool = False  # its body's `model` may name no served model: OpenAI's 404
    finds: bool = False  # its path names something that may not be there (a stored response): 404


async def handle_openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_json())


@functools.cache
def openapi_json() -> dict:
    return openapi_document(DOCUMENTED, gaudi_runtime.__version__)


TGI, OPENAI, OPS = "Text Generation Inference", "OpenAI", "Operations"
GENERATE = dict(bodies=(GenerateRequest,), generates=True, tag=TGI)
ROUTES = (
    Route("POST", "/generate", tgi_api.handle_generate, replies=(rm.GenerateResponse,),
          summary="Generate tokens", **GENERATE),
    Route("POST", "/generate_stream", tgi_api.handle_generate_stream, events=(rm.StreamResponse,),
          summary="Generate a stream of tokens (server-sent events)", **GENERATE),
    Route("POST", "/", tgi_api.handle_compat, replies=(rm.CompatGenerateResponse,), events=(rm.StreamResponse,),
          summary="Generate, streaming when the body's `stream` is true", **GENERATE),
    Route("POST", "/invocations", handle_invocations, (ChatCompletionRequest, CompletionRequest, GenerateRequest),
          replies=(rm.ChatCompletion, rm.Completion, rm.CompatGenerateResponse),
          events=(rm.ChatCompletionChunk, rm.CompletionChunk, rm.StreamResponse), generates=True, done_marker=True,
          summary="SageMaker: a chat, completions or TGI body", tag="SageMaker", selects_model=True),
    Route("POST", "/tokenize", tgi_api.handle_tokenize, (TokenizeRequest,), replies=(rm.TokenizeResponse,),
          summary="Tokenize the inputs", tag=TGI),
    Route("POST", "/v1/completions", openai_api.handle_completions, (CompletionRequest,),
          replies=(rm.Completion,), events=(rm.CompletionChunk,), generates=True, done_marker=True,
          summary="OpenAI completions", tag=OPENAI, selects_model=True),
    Route("POST", "/v1/chat/completions", openai_api.handle_chat, (ChatCompletionRequest,),
          replies=(rm.ChatCompletion,), events=(rm.ChatCompletionChunk,), generates=True, done_marker=True,
          summary="OpenAI chat completions", tag=OPENAI, selects_model=True),
    Route("POST", "/v1/responses", responses_api.handle_create, (rsp.ResponsesRequest,), replies=(rsp.Response,),
          events=rsp.STREAM_EVENTS, generates=True, summary="OpenAI responses (on the chat path)", tag=OPENAI,
          selects_model=True, finds=True),
    Route("GET", "/v1/responses/{response_id}", responses_api.handle_get, replies=(rsp.Response,),
          summary="A stored response", tag=OPENAI, finds=True),
    Route("DELETE", "/v1/responses/{response_id}", responses_api.handle_delete, replies=(rsp.ResponseDeleted,),
          summary="Delete a stored response", tag=OPENAI, finds=True),
    Route("GET", "/info", tgi_api.handle_info, replies=(rm.Info,), summary="The model and the server's limits",
          tag=TGI),
    Route("GET", "/v1/models", openai_api.handle_models, replies=(rm.ModelList,),
          summary="The served model and each of its LoRA adapters",
          tag=OPENAI),
    Route("GET", "/health", tgi_api.handle_health, replies=(rm.HealthResponse,), unready=rm.HealthResponse,
          summary="Ready to serve (200), or not yet, with the warmup's progress (503)", tag=OPS, open=True),
    Route("GET", "/ping", tgi_api.handle_ping, replies=(rm.PingResponse,), summary="The process answers",
          tag=OPS, open=True),
    Route("GET", "/livez", tgi_api.handle_livez, open=True, documented=False),
    Route("GET", "/metrics", tgi_api.handle_metrics, media="text/plain", summary="Prometheus metrics",
          tag=OPS, open=True),
    Route("GET", "/api-doc/openapi.json", handle_openapi, open=True, documented=False),
    Route("GET", "/docs", docs_ui.handle_docs, open=True, documented=False),
    Route("GET", "/docs/{name}", docs_ui.handle_docs_asset, open=True, documented=False),
)


# vLLM's runtime LoRA updating: served only with --allow-runtime-lora-updating (404 otherwise, as in vLLM);
# answers in vLLM's shapes: a line of text on success, OpenAI's error body otherwise.
LORA_ROUTES = (
    Route("POST", "/v1/load_lora_adapter", lora_api.handle_load, (LoadLoraAdapterRequest,), media="text/plain",
          summary="Load a LoRA adapter while serving (--allow-runtime-lora-updating)", tag=OPENAI, finds=True),
    Route("POST", "/v1/unload_lora_adapter", lora_api.handle_unload, (UnloadLoraAdapterRequest,),
          media="text/plain", summary="Unload a LoRA adapter (--allow-runtime-lora-updating)", tag=OPENAI,
          finds=True),
)
DOCUMENTED = tuple(r for r in ROUTES + LORA_ROUTES if r.documented)


def add_routes(app: web.Application, runtime_lora_updating: bool = False) -> None:
    app[RESPONSES] = ResponseStore()
    for route in ROUTES + (LORA_ROUTES if runtime_lora_updating else ()):
        app.router.add_route(route.method, route.path, route.handler)


def open_route(request: web.Request) -> bool:
    """Whether the request's route needs neither the API key nor a ready server (unknown paths
    get their 404 or 405 either way)."""
    info = request.match_info
    if info.http_exception is not None:
        return True
    resource = info.route.resource
    return resource is not None and resource.canonical in OPEN_PATHS


OPEN_PATHS = frozenset(r.path for r in ROUTES if r.open)
