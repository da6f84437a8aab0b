"""The API's contract as a client reads it: /api-doc/openapi.json describes every route of the route
table with its request and response schemas, Swagger UI at /docs runs on files the server itself
serves, both stay open without the API key, and what the server answers fits the documented models
(the fuzz test, tests/runtime/test_fuzz_api.py, holds the real server to the same document)."""

from __future__ import annotations

import json
import re

import pytest
import schemathesis

from gaudi_runtime.router import response_models as rm
from gaudi_runtime.router.routes import ROUTES
from tests.runtime.test_http_api import call, stream

pytestmark = pytest.mark.slow


async def test_the_document_describes_every_route_of_the_table(fake_server):
    status, doc, headers = await call(fake_server.url, "/api-doc/openapi.json", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    schemathesis.openapi.from_dict(json.loads(json.dumps(doc))).validate()  # a valid OpenAPI 3.1 document
    assert doc["openapi"] == "3.1.0"
    documented = {(r.method.lower(), r.path) for r in ROUTES if r.documented}
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == documented
    schemas = doc["components"]["schemas"]
    for r in ROUTES:
        if not r.documented:
            continue
        op = doc["paths"][r.path][r.method.lower()]
        refs = json.dumps(op)
        for model in (*r.bodies, *r.replies, *r.events):
            assert f'"#/components/schemas/{model.__name__}"' in refs, (r.path, model)
            assert model.__name__ in schemas
        codes = set(op["responses"])
        assert "200" in codes
        assert ({"401", "503"} <= codes) != r.open, r.path
        assert ({"413", "422"} <= codes) == bool(r.bodies), r.path
    generate = schemas["GenerateParameters"]["properties"]
    assert generate["stop"]["anyOf"][0] == {"anyOf": [{"type": "string"}, {"items": {"type": "string"},
                                                                             "type": "array"}]}
    assert {"type": "null"} in generate["details"]["anyOf"]  # null is absent, and documented so
    stream_events = doc["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert stream_events["schema"]["properties"]["data"]["contentSchema"]["oneOf"][0] == {
        "$ref": "#/components/schemas/StreamResponse"}


async def test_swagger_ui_is_served_from_the_package_with_no_outside_link(make_server):
    s = make_server(API_KEY="k")  # the description of the API needs no key; the API does
    status, page, headers = await call(s.url, "/docs", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "//" not in re.sub(r"<!DOCTYPE[^>]*>", "", page).replace("://", "")  # no absolute URL at all
    assets = re.findall(r'(?:src|href)="(docs/[^"]+)"', page)
    assert {"docs/swagger-ui-bundle.js", "docs/swagger-ui.css"} <= set(assets)
    for asset in assets:
        status, body, headers = await call(s.url, "/" + asset, method="GET")
        assert status == 200 and len(body) > 100, asset
    assert "javascript" in (await call(s.url, "/docs/swagger-ui-bundle.js", method="GET"))[2]["Content-Type"]
    assert 'url: "api-doc/openapi.json"' in page
    assert (await call(s.url, "/api-doc/openapi.json", method="GET"))[0] == 200
    for name in ("index.html", "..%2F..%2Fconfig.py", "swagger-ui.js.map"):
        assert (await call(s.url, f"/docs/{name}", method="GET"))[0] == 404, name
    assert (await call(s.url, "/v1/models", method="GET"))[0] == 401


def _check(model, body) -> None:
    model.model_validate(body, strict=True)


async def test_answers_fit_the_documented_models(fake_server):
    """Every response shape the handlers build, with the options that add fields, read back by its model."""
    url = fake_server.url
    params = {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "max_new_tokens": 20}
    _check(rm.GenerateResponse, (await call(url, "/generate", {"inputs": "a b", "parameters": params}))[1])
    best_of = {"best_of": 2, "do_sample": True, "details": True, "top_n_tokens": 1}
    _check(rm.GenerateResponse, (await call(url, "/generate", {"inputs": "a b", "parameters": best_of}))[1])
    _check(rm.CompatGenerateResponse, (await call(url, "/", {"inputs": "a b"}))[1])
    status, events, _ = await stream(url, "/generate_stream", {"inputs": "a b", "parameters": {"top_n_tokens": 2}})
    assert status == 200 and events[-1]["details"] is not None
    for e in events:
        _check(rm.StreamResponse, e)
    completion = {"prompt": ["a b", "c"], "logprobs": 2, "echo": True}
    _check(rm.Completion, (await call(url, "/v1/completions", completion))[1])
    _, chunks, _ = await stream(url, "/v1/completions", {**completion, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]
    for c in chunks[:-1]:
        _check(rm.CompletionChunk, c)
    chat = {"messages": [{"role": "user", "content": "a b"}], "logprobs": True, "top_logprobs": 2}
    _check(rm.ChatCompletion, (await call(url, "/v1/chat/completions", chat))[1])
    _, chunks, _ = await stream(url, "/v1/chat/completions", {**chat, "stream": True})
    for c in chunks[:-1]:
        _check(rm.ChatCompletionChunk, c)
    _check(rm.TokenizeResponse, (await call(url, "/tokenize", {"inputs": "a b"}))[1])
    for path, model in [("/info", rm.Info), ("/v1/models", rm.ModelList), ("/health", rm.HealthResponse),
                        ("/ping", rm.PingResponse)]:
        _check(model, (await call(url, path, method="GET"))[1])
    status, error, _ = await call(url, "/generate", {"inputs": ""})
    assert status == 422
    _check(rm.ErrorResponse, error)
