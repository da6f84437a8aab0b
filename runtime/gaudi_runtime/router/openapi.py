"""The OpenAPI document of the router, generated from the route table and the pydantic models.

    document = openapi_document(ROUTES, version)   # served at /api-doc/openapi.json

Each route says what it takes (its request models) and what it answers (response models, events,
or another media type); the errors follow from what the route does: a body can be refused (422,
413), a generation can fail or be refused (424, 429), and every route that is not open needs the
API key (401) and a server that is ready (503). The /v1 routes answer OpenAI's error body with
OpenAI's statuses instead (400 for 422, 500 for 424 and for a failure of the server's own).
Nothing here is written by hand per route, so the document cannot drift from the table. OpenAPI
3.1, whose schemas are JSON Schema as pydantic writes it. A streaming answer is `text/event-stream`, each event's `data` being the JSON of its models.
Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gaudi_runtime.router.response_models import ErrorResponse, OpenAIError

REF = "#/components/schemas/{model}"
ERRORS = {
    401: "The API key is missing or wrong (`--api-key`)",
    404: "`model` names neither the served model nor one of its LoRA adapters, or the stored response asked "
         "for is not there (OpenAI's error body)",
    413: "The body is larger than `--max-request-bytes`",
    422: "The body is invalid or over a limit; the message names the field",
    424: "The generation failed",
    429: "Too many requests in flight (`--max-concurrent-requests`)",
    503: "The server is not ready (loading, warming up with its progress, or failed)",
}
# The /v1 routes' errors: OpenAI's body (router/openai_errors.py), with OpenAI's statuses where TGI's differ.
OPENAI_ERRORS = {
    400: "The body is invalid or over a limit (a prompt too long: code `context_length_exceeded`)",
    500: "The generation failed, or the server did",
}
OPENAI_STATUS = {422: 400, 424: 500}


def _models(routes) -> list[tuple[type[BaseModel], str]]:
    found: dict[type[BaseModel], str] = {ErrorResponse: "serialization", OpenAIError: "serialization"}
    for r in routes:
        for m in r.bodies:
            found.setdefault(m, "validation")
        for m in (*r.replies, *r.events, *((r.unready,) if r.unready else ())):
            found.setdefault(m, "serialization")
    return list(found.items())


def _one_of(refs: list[dict]) -> dict:
    return refs[0] if len(refs) == 1 else {"oneOf": refs}


def _openai(route) -> bool:
    return route.path.startswith("/v1/")


def _error_ref(route) -> dict:
    return {"$ref": REF.format(model="OpenAIError" if _openai(route) else "ErrorResponse")}


def _event_schema(route, refs: list[dict]) -> dict:
    """One server-sent event: its `data` is JSON of one of `refs` (or of an error ending the stream)."""
    done_marker = route.done_marker
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": _one_of([*refs, _error_ref(route)])}
    data = {"anyOf": [json_data, {"const": "[DONE]"}]} if done_marker else json_data
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def _ok(route, refs: dict) -> dict:
    content: dict[str, Any] = {}
    if route.replies:
        content["application/json"] = {"schema": _one_of([refs[m] for m in route.replies])}
    if route.events:
        content["text/event-stream"] = {"schema": _event_schema(route, [refs[m] for m in route.events])}
    if route.media:
        content[route.media] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content} if content else {"description": "OK"}


def _error(status: int, schema: dict) -> dict:
    description = OPENAI_ERRORS.get(status) or ERRORS[status]
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _responses(route, refs: dict) -> dict:
    out = {"200": _ok(route, refs)}
    codes = [413, 422] if route.bodies else []
    codes += [424, 429] if route.generates else []
    codes += [] if route.open else [401, 503]
    if _openai(route):
        codes = list({OPENAI_STATUS.get(c, c) for c in codes} | {500})
    for code in sorted(codes):
        out[str(code)] = _error(code, _error_ref(route))
    if route.unready is not None:
        out["503"] = _error(503, refs[route.unready])
    if route.selects_model or route.finds:
        out["404"] = _error(404, refs[OpenAIError])
    return out


def _operation(route, refs: dict) -> dict:
    op: dict[str, Any] = {"summary": route.summary, "operationId": _operation_id(route),
                          "tags": [route.tag], "responses": _responses(route, refs)}
    if route.bodies:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _one_of([refs[m] for m in route.bodies])}}}
    params = re.findall(r"{(\w+)}", route.path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                            for p in params]
    op["security"] = [] if route.open else [{"bearer": []}, {}]
    return op


def _operation_id(route) -> str:
    name = re.sub(r"[{}]", "", route.path.strip("/")).replace("/", "_").replace(".", "_") or "compat_generate"
    return f"{route.method.lower()}_{name}"


def openapi_document(routes, version: str) -> dict:
    """OpenAPI 3.1 for every documented route of `routes` (router.routes.ROUTES)."""
    documented = [r for r in routes if r.documented]
    keys, defs = models_json_schema(_models(documented), ref_template=REF)
    refs = {model: ref for (model, _mode), ref in keys.items()}
    paths: dict[str, dict] = {}
    for r in documented:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gaudi-serve", "version": version,
                 "description": "Text Generation Inference's API and OpenAI's completions and chat, "
                                "served on Intel Gaudi.",
                 "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "The key of `--api-key`, when set"}}},
    }
