"""The API's contract as a client reads it: /api-doc/openapi.json describes every route of the route
table with its request and response schemas, Swagger UI at /docs runs on files the server itself
serves, both stay open without the API key, and every kind of answer the server sends (bodies,
each event of each stream, errors) follows that document (tests/runtime/conformance.py): tool
calls, several choices, log-probabilities, usage chunks, best_of, details. A builder that strays
from its model fails here. The fuzz test (tests/runtime/test_fuzz_api.py) holds the real server to
the same document for the bodies it makes up."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest
import schemathesis

from gaudi_runtime.router import openai_api, tgi_api
from gaudi_runtime.router.routes import DOCUMENTED
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.conformance import Contract
from tests.runtime.test_http_api import call, sse_frames

pytestmark = pytest.mark.slow


async def test_the_document_describes_every_route_of_the_table(fake_server):
    status, doc, headers = await call(fake_server.url, "/api-doc/openapi.json", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    schemathesis.openapi.from_dict(json.loads(json.dumps(doc))).validate()  # a valid OpenAPI 3.1 document
    assert doc["openapi"] == "3.1.0"
    documented = {(r.method.lower(), r.path) for r in DOCUMENTED}  # the LoRA admin routes included
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == documented
    schemas = doc["components"]["schemas"]
    for r in DOCUMENTED:
        op = doc["paths"][r.path][r.method.lower()]
        refs = json.dumps(op)
        for model in (*r.bodies, *r.replies, *r.events):
            assert f'"#/components/schemas/{model.__name__}"' in refs, (r.path, model)
            assert model.__name__ in schemas
        codes = set(op["responses"])
        assert "200" in codes
        assert ({"401", "503"} <= codes) != r.open, r.path
        refused = {"413", "400"} if r.path.startswith("/v1/") else {"413", "422"}
        assert (refused <= codes) == bool(r.bodies), r.path
        if r.path.startswith("/v1/"):  # OpenAI's error body on every /v1 error
            assert {json.dumps(e["content"]["application/json"]["schema"]) for c, e in op["responses"].items()
                    if c != "200"} == {'{"$ref": "#/components/schemas/OpenAIError"}'}, r.path
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


# --- every kind of answer, checked against the document the server serves -----------------------

class CheckedClient:
    """Calls a server and checks each answer against the document it serves before returning it
    (parsed: a JSON body, or a stream's events with `[DONE]` as the string)."""

    def __init__(self, url: str, contract: Contract, headers: dict | None = None):
        self.url, self.contract, self.headers = url, contract, headers or {}

    @classmethod
    async def of(cls, url: str, headers: dict | None = None) -> CheckedClient:
        status, doc, _ = await call(url, "/api-doc/openapi.json", method="GET")
        assert status == 200
        return cls(url, Contract(doc), headers)

    async def raw(self, path: str, body=None, *, method: str = "POST", headers: dict | None = None,
                  data: bytes | None = None) -> tuple[int, str, str]:
        async with aiohttp.ClientSession() as s:
            kwargs: dict = {"headers": {**self.headers, **(headers or {})}}
            if data is not None:
                kwargs["data"] = data
            elif body is not None:
                kwargs["json"] = body
            async with s.request(method, self.url + path, **kwargs) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.text()

    async def __call__(self, path: str, body=None, *, method: str = "POST", status: int = 200, **kw):
        got, ctype, text = await self.raw(path, body, method=method, **kw)
        assert got == status, (path, body, got, text[:500])
        if ctype.startswith("text/event-stream"):
            payloads = sse_frames(text)
            self.contract.check(method, path, got, ctype, payloads)
            return [p if p == "[DONE]" else json.loads(p) for p in payloads]
        parsed = json.loads(text)
        self.contract.check(method, path, got, ctype, parsed)
        return parsed


def _choices(chunks: list) -> dict[int, list[dict]]:
    """A stream's chunks of each choice (the usage chunk has none)."""
    out: dict[int, list[dict]] = {}
    for c in chunks:
        if c != "[DONE]":
            for choice in c["choices"]:
                out.setdefault(choice["index"], []).append(choice)
    return out


def _assert_openai_stream(chunks: list, choices: int, usage: bool) -> None:
    """`choices` choices, each ended by one chunk with its finish_reason; the usage chunk (no choice)
    just before `[DONE]` when asked for."""
    assert chunks[-1] == "[DONE]"
    per_choice = _choices(chunks)
    assert sorted(per_choice) == list(range(choices))
    for pieces in per_choice.values():
        assert [p["finish_reason"] is not None for p in pieces][-1] and \
            all(p["finish_reason"] is None for p in pieces[:-1]), pieces
    tail = chunks[-2]
    assert (tail["choices"] == [] and tail["usage"]["total_tokens"] > 0) == usage, tail
    assert all(c["usage"] is None for c in chunks[:-2])


MESSAGES = [{"role": "user", "content": "hello world"}]
USAGE = {"stream_options": {"include_usage": True}}


async def test_tgi_answers_follow_the_document(server_url):
    """/generate with details, prompt details, top tokens and best_of; `/` as a list and as a stream;
    /generate_stream's token events and its last event with details; /tokenize."""
    api = await CheckedClient.of(server_url)
    details = {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "max_new_tokens": 6}
    body = await api("/generate", {"inputs": "hello world", "parameters": details})
    d = body["details"]
    assert len(d["tokens"]) == len(d["top_tokens"]) == d["generated_tokens"] and d["prefill"]
    body = await api("/generate", {"inputs": "hello world", "parameters": {
        "best_of": 2, "do_sample": True, "details": True, "top_n_tokens": 1, "max_new_tokens": 6}})
    assert len(body["details"]["best_of_sequences"]) == 1 and body["details"]["seed"] is not None
    assert set(await api("/generate", {"inputs": "hello world", "parameters": {"max_new_tokens": 3}})) == \
        {"generated_text"}
    assert len(await api("/", {"inputs": "hello", "parameters": {"details": True, "max_new_tokens": 3}})) == 1
    for path, extra in (("/generate_stream", {}), ("/", {"stream": True})):
        events = await api(path, {"inputs": "hello world", **extra, "parameters": {
            "top_n_tokens": 2, "do_sample": True, "seed": 3, "max_new_tokens": 5}})
        assert events[-1]["details"]["seed"] == 3 and events[-1]["generated_text"] is not None
        assert all(e["details"] is None and len(e["top_tokens"]) == 2 for e in events[:-1])
    assert [t["text"] for t in await api("/tokenize", {"inputs": "hello world"})]


async def test_completions_follow_the_document(server_url):
    """Several prompts and choices with log-probabilities and echo, best_of, and their streams with
    the usage chunk."""
    api = await CheckedClient.of(server_url)
    body = {"prompt": ["hello world", "the gaudi card"], "n": 2, "logprobs": 2, "echo": True, "max_tokens": 5}
    answer = await api("/v1/completions", body)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert all(len(c["logprobs"]["top_logprobs"]) == len(c["logprobs"]["tokens"]) for c in answer["choices"])
    answer = await api("/v1/completions", {"prompt": "hello", "n": 1, "best_of": 2, "max_tokens": 4})
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None
    chunks = await api("/v1/completions", {**body, "stream": True, **USAGE})
    _assert_openai_stream(chunks, 4, usage=True)
    assert all(c["logprobs"]["token_logprobs"] for cs in _choices(chunks).values() for c in cs)
    _assert_openai_stream(await api("/v1/completions", {"prompt": "hello", "stream": True, "max_tokens": 3}),
                          1, usage=False)


async def test_chat_follows_the_document(server_url):
    """Several choices with log-probabilities and their top alternatives, whole and streamed, with
    and without the usage chunk."""
    api = await CheckedClient.of(server_url)
    body = {"messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 2, "max_tokens": 5}
    answer = await api("/v1/chat/completions", body)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for c in answer["choices"]:
        assert c["message"]["content"] is not None and "tool_calls" not in c["message"]
        assert all(len(lp["top_logprobs"]) == 2 for lp in c["logprobs"]["content"])
    chunks = await api("/v1/chat/completions", {**body, "stream": True, **USAGE})
    _assert_openai_stream(chunks, 2, usage=True)
    assert all(c["logprobs"]["content"] for cs in _choices(chunks).values() for c in cs)
    _assert_openai_stream(await api("/v1/chat/completions", {"messages": MESSAGES, "stream": True,
                                                               "max_tokens": 3}), 1, usage=False)


async def test_every_other_route_follows_the_document(server_url):
    """SageMaker's /invocations with each API's body, whole and streamed; /info, /v1/models, /health,
    /ping."""
    api = await CheckedClient.of(server_url)
    assert (await api("/invocations", {"messages": MESSAGES, "max_tokens": 3}))["object"] == "chat.completion"
    assert (await api("/invocations", {"prompt": "hello", "max_tokens": 3}))["object"] == "text_completion"
    assert "generated_text" in (await api("/invocations", {"inputs": "hello", "parameters": {"max_new_tokens": 3}}))[0]
    for body in ({"messages": MESSAGES, "max_tokens": 3, "stream": True, **USAGE},
                 {"prompt": "hello", "max_tokens": 3, "stream": True, **USAGE}):
        _assert_openai_stream(await api("/invocations", body), 1, usage=True)
    assert (await api("/invocations", {"inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 3}}))[-1][
        "details"]
    for path in ("/info", "/v1/models", "/health", "/ping"):
        await api(path, method="GET")


async def test_errors_follow_the_document(make_server):
    """Each error status with TGI's body on TGI's routes and OpenAI's on /v1, and the error event
    that ends each kind of stream."""
    s = make_server(MAX_REQUEST_BYTES="4096")
    api = await CheckedClient.of(s.url)
    await api("/generate", {"inputs": ""}, status=422)
    assert (await api("/v1/chat/completions", {"messages": []}, status=400))["error"]["type"] == "BadRequestError"
    await api("/v1/completions", {"prompt": "x", "n": 99}, status=400)
    too_long = (await api("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, status=400))["error"]
    assert too_long["code"] == "context_length_exceeded" and "maximum context length" in too_long["message"]
    huge = b'{"inputs": "' + b"x" * 5000 + b'"}'
    await api("/generate", data=huge, status=413, headers={"Content-Type": "application/json"})
    await api("/v1/completions", data=huge, status=413, headers={"Content-Type": "application/json"})
    await api("/generate", {"inputs": "FAIL:generation"}, status=424)
    await api("/v1/completions", {"prompt": "FAIL:generation"}, status=500)
    await api("/generate_stream", {"inputs": "FAIL:overloaded"}, status=429)
    assert (await api("/v1/completions", {"prompt": "FAIL:overloaded", "stream": True}, status=429))["error"][
        "type"] == "RateLimitError"
    events = await api("/generate_stream", {"inputs": "FAIL:after=2 hello world"})
    assert events[-1]["error_type"] == "generation", events
    for path, body in (("/v1/completions", {"prompt": "FAIL:after=2 hello world", "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL:after=2 hello"}],
                                                 "stream": True})):
        events = await api(path, body)
        assert events[-1]["error"]["type"] == "InternalServerError", events
    s.engine.healthy = False
    s.engine.health_body = {"status": "warming_up", "warmup": {"done": 1, "total": 3, "phase": "prefill"}}
    assert (await api("/generate", {"inputs": "hello"}, status=503))["warmup"]["total"] == 3
    assert (await api("/v1/completions", {"prompt": "hello"}, status=503))["error"]["type"] == \
        "ServiceUnavailableError"
    assert (await api("/health", method="GET", status=503))["status"] == "warming_up"
    locked = await CheckedClient.of(make_server(API_KEY="k").url)
    assert (await locked("/v1/models", method="GET", status=401))["error"]["code"] == "invalid_api_key"
    await locked("/v1/models", method="GET", headers={"Authorization": "Bearer k"})


# --- tool calls: the fake engine answers with a call in the model's format (Qwen2.5's, Hermes) ---

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def _ask(reply: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": f"REPLY<<{reply}>>END"}], "tools": TOOLS, "max_tokens": 300,
            **extra}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from tests.runtime.conftest import _serve

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tools") / "qwen2", "qwen2")
    s = _serve(str(model_dir), MAX_INPUT_TOKENS="1500", MAX_TOTAL_TOKENS="2048")
    yield s
    s.thread.stop()


async def test_tool_calls_follow_the_document(tool_server):
    """A message of calls only has content null and finish_reason tool_calls; text before a call is
    its content; several calls and choices, with log-probabilities; text alone has no tool_calls."""
    api = await CheckedClient.of(tool_server.url)
    answer = await api("/v1/chat/completions", _ask(WEATHER))
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (called,) = choice["message"]["tool_calls"]
    assert called["function"]["name"] == "get_weather"
    assert json.loads(called["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    answer = await api("/v1/chat/completions", _ask("Let me look.\n" + WEATHER + "\n" + TIME, n=2, logprobs=True,
                                                    top_logprobs=2))
    for choice in answer["choices"]:
        assert choice["message"]["content"].startswith("Let me look.")
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
        assert choice["finish_reason"] == "tool_calls" and choice["logprobs"]["content"]
    answer = await api("/v1/chat/completions", _ask("It is sunny."))
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_streamed_tool_calls_follow_the_document(tool_server):
    """Content and call deltas, the empty delta that ends a choice with finish_reason tool_calls, and
    the usage chunk; the pieces add up to the calls, and their log-probabilities to the whole
    answer's, one per token."""
    api = await CheckedClient.of(tool_server.url)
    body = _ask("Let me look.\n" + WEATHER + "\n" + TIME, n=2, logprobs=True)
    whole = await api("/v1/chat/completions", body)
    chunks = await api("/v1/chat/completions", {**body, "stream": True, **USAGE})
    _assert_openai_stream(chunks, 2, usage=True)
    assert chunks[-2]["usage"] == whole["usage"]
    for i, pieces in _choices(chunks).items():
        assert [lp["token"] for p in pieces if p["logprobs"] for lp in p["logprobs"]["content"]] == \
            [lp["token"] for lp in whole["choices"][i]["logprobs"]["content"]]
        assert pieces[-1]["delta"] == {} and pieces[-1]["finish_reason"] == "tool_calls"
        content = "".join(p["delta"].get("content", "") for p in pieces)
        calls: dict[int, dict] = {}
        for p in pieces:
            for d in p["delta"].get("tool_calls", []):
                call_ = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                call_["name"] += d["function"].get("name", "")
                call_["arguments"] += d["function"]["arguments"]
        assert content.startswith("Let me look.")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]


@pytest.fixture(scope="module")
def real_tool_server(tmp_path_factory):
    """The real runtime on a tiny Qwen2 model (Hermes tool calls), room for its tool prompt."""
    from tests.runtime.launched import launch

    model_dir = make_tiny_model(tmp_path_factory.mktemp("real-tools") / "qwen2", "qwen2")
    srv = launch(model_dir, tmp_path_factory.mktemp("real-tools-run"), "--dtype", "float32",
                 "--max-input-tokens", "1024", "--max-total-tokens", "1280", "--max-batch-prefill-tokens", "2048",
                 "--max-batch-size", "8", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "128", "BATCH_BUCKET_SIZE": "8",
                                               "PREFILL_BATCH_BUCKET_SIZE": "4", "EXPONENTIAL_BUCKETING": "true",
                                               "WARMUP_ENABLED": "false"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


async def test_forced_tool_calls_of_the_real_runtime_follow_the_document(real_tool_server):
    """`tool_choice: required` makes the grammar force a call out of random weights: whole and
    streamed, with several choices and log-probabilities, the answers follow the document."""
    api = await CheckedClient.of(real_tool_server.url)
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS[:1],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120, "n": 2, "logprobs": True,
            "top_logprobs": 1, "temperature": 1.0, "seed": 7}
    answer = await api("/v1/chat/completions", body)
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    chunks = await api("/v1/chat/completions", {**body, "stream": True, **USAGE})
    _assert_openai_stream(chunks, 2, usage=True)
    for pieces in _choices(chunks).values():
        assert pieces[-1]["finish_reason"] == "tool_calls", pieces[-1]
        assert any(d.get("function", {}).get("name") == "get_weather"
                   for p in pieces for d in p["delta"].get("tool_calls", []))


# --- the check fails when a builder strays from its model ---------------------------------------

async def _fails(api: CheckedClient, path: str, body: dict, what: str) -> None:
    with pytest.raises(AssertionError, match=what):
        await api(path, body)


async def test_the_check_fails_when_a_builder_strays_from_its_model(fake_server, tool_server, monkeypatch):
    """Each builder made to send what its model does not say (a wrong type, a value outside the
    model's, a field it does not name): the check that passes on the real builder fails."""
    api, tools = await CheckedClient.of(fake_server.url), await CheckedClient.of(tool_server.url)
    stream_tgi = ("/generate_stream", {"inputs": "hello world", "parameters": {"max_new_tokens": 4}})
    chat = ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "logprobs": True})
    chat_stream = ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True})
    completion = ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "logprobs": 1})
    for path, body in (stream_tgi, chat, chat_stream, completion):
        await api(path, body)
    tool_call = ("/v1/chat/completions", _ask(WEATHER))
    await tools(*tool_call)
    with monkeypatch.context() as m:  # the per-token template of /generate_stream: an id as a string
        token_text = tgi_api.token_text
        m.setattr(tgi_api, "token_text", lambda t: token_text(t).replace(f'"id": {t.id}', f'"id": "{t.id}"', 1))
        await _fails(api, *stream_tgi, "is not of type 'integer'")
    with monkeypatch.context() as m:  # a finish reason that is TGI's, not OpenAI's
        for reason in list(openai_api.FINISH):
            m.setitem(openai_api.FINISH, reason, "eos_token")
        await _fails(api, *chat, "eos_token")
        await _fails(api, *chat_stream, "eos_token")
    with monkeypatch.context() as m:  # a field no model names
        wrap = openai_api.Envelope.wrap
        m.setattr(openai_api.Envelope, "wrap", lambda self, *a, **k: {**wrap(self, *a, **k), "service_tier": None})
        await _fails(api, *completion, "service_tier")
    with monkeypatch.context() as m:  # log-probabilities' bytes as text
        chat_logprobs = openai_api.chat_logprobs

        def as_text(*a):
            lps = chat_logprobs(*a)
            return {"content": [{**lp, "bytes": lp["token"]} for lp in lps["content"]]}

        m.setattr(openai_api, "chat_logprobs", as_text)
        await _fails(api, *chat, "is not of type 'array'")
    with monkeypatch.context() as m:  # a call's arguments as an object, not JSON text
        calls_json = openai_api.tool_calls_json
        m.setattr(openai_api, "tool_calls_json", lambda calls: [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls_json(calls)])
        await _fails(tools, *tool_call, "is not of type 'string'")
