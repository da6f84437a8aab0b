"""The HTTP layer on a real aiohttp server (loopback) over the fake engine: every
route, every rejected input with its status and error body, SSE framing, API key,
CORS, metrics, and that closing a stream closes the engine's request."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from tests.runtime.fake_engine import async_wait_for

pytestmark = pytest.mark.slow

EOS = "</s>"


async def call(url: str, path: str, body=None, *, method: str = "POST", data: bytes | None = None,
               headers: dict | None = None) -> tuple[int, object, aiohttp.typedefs.LooseHeaders]:
    async with aiohttp.ClientSession() as s:
        kwargs: dict = {"headers": headers or {}}
        if data is not None:
            kwargs["data"] = data
        elif body is not None:
            kwargs["json"] = body
        async with s.request(method, url + path, **kwargs) as r:
            raw = await r.read()
            ctype = r.headers.get("Content-Type", "")
            if "json" in ctype and raw:
                parsed = json.loads(raw)
            else:
                parsed = raw.decode("utf-8", errors="replace")
            return r.status, parsed, r.headers


def sse_frames(text: str) -> list[str]:
    """Payloads of `data: ...` frames; asserts the framing."""
    assert text.endswith("\n\n"), text[-80:]
    frames = text[:-2].split("\n\n")
    out = []
    for f in frames:
        assert f.startswith("data: "), f
        assert "\n" not in f
        payload = f[len("data: "):]
        if payload != "[DONE]":  # every event as json.dumps writes it: the same bytes for every client
            assert payload == json.dumps(json.loads(payload), ensure_ascii=False), payload
        out.append(payload)
    return out


async def stream(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, list, dict]:
    status, text, h = await call(url, path, body, headers=headers)
    if status != 200:
        return status, text, h
    assert h["Content-Type"].startswith("text/event-stream")
    payloads = sse_frames(text)
    return status, [p if p == "[DONE]" else json.loads(p) for p in payloads], h


OPENAI_STATUS = {422: 400, 424: 500}  # TGI's status -> OpenAI's, for the same error on a /v1 route
OPENAI_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def assert_error(status, body, want_status, want_type, message: str | None = None):
    """TGI's error (`want_status`, `want_type`); or, where the answer is OpenAI's envelope (the /v1
    routes), the same error in OpenAI's shape with OpenAI's status."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        assert_openai_error(status, body, OPENAI_STATUS.get(want_status, want_status), message)
        return
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error", "error_type"}, body
    assert body["error_type"] == want_type
    if message is not None:
        assert message in body["error"], body


def assert_openai_error(status, body, want_status, message: str | None = None):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == OPENAI_TYPE[want_status], body
    if message is not None:
        assert message in body["error"]["message"], body


# --- /generate ---------------------------------------------------------------------------

async def test_generate_details_shape(fake_server, router_tokenizer):
    prompt = "hello world 東京"
    status, body, headers = await call(fake_server.url, "/generate", {
        "inputs": prompt,
        "parameters": {"max_new_tokens": 50, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    assert status == 200, body
    ids = router_tokenizer.encode(prompt)
    assert body["generated_text"] == prompt  # the fake echoes the prompt, then EOS
    d = body["details"]
    assert d["finish_reason"] == "eos_token"
    assert d["generated_tokens"] == len(ids) + 1
    assert d["seed"] is None  # greedy
    assert [t["id"] for t in d["prefill"]] == ids
    assert d["prefill"][0]["logprob"] is None and set(d["prefill"][0]) == {"id", "text", "logprob"}
    assert [t["id"] for t in d["tokens"]] == ids + [router_tokenizer.eos_token_id]
    assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert d["tokens"][-1] == {"id": router_tokenizer.eos_token_id, "text": EOS, "logprob": -0.25, "special": True}
    assert len(d["top_tokens"]) == len(d["tokens"]) and all(len(t) == 2 for t in d["top_tokens"])
    assert "best_of_sequences" not in d
    assert headers["x-generated-tokens"] == str(len(ids) + 1)
    assert headers["x-prompt-tokens"] == str(len(ids))


async def test_generate_without_details(fake_server):
    status, body, _ = await call(fake_server.url, "/generate", {"inputs": "hello world"})
    assert status == 200
    assert body == {"generated_text": "hello world"}


async def test_finish_reasons_and_full_text(fake_server):
    url = fake_server.url
    _, b, _ = await call(url, "/generate", {"inputs": "the gaudi card serve request",
                                            "parameters": {"max_new_tokens": 2, "details": True}})
    assert b["details"]["finish_reason"] == "length" and b["details"]["generated_tokens"] == 2
    _, b, _ = await call(url, "/generate", {"inputs": "the gaudi card serve request",
                                            "parameters": {"stop": ["card"], "details": True}})
    assert b["details"]["finish_reason"] == "stop_sequence"
    assert b["generated_text"].endswith("card")  # the stop sequence is kept, as TGI
    _, b, _ = await call(url, "/generate", {"inputs": "hello world",
                                            "parameters": {"return_full_text": True}})
    assert b["generated_text"] == "hello worldhello world"


async def test_ignore_eos_token_setting(make_server):
    s = make_server(TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN="true")
    _, b, _ = await call(s.url, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 7,
                                                                                "details": True}})
    assert b["details"]["finish_reason"] == "length" and b["details"]["generated_tokens"] == 7
    assert s.engine.finished[-1].stopping.ignore_eos_token is True


async def test_sampling_returns_seed(fake_server):
    _, b, h = await call(fake_server.url, "/generate", {"inputs": "hello", "parameters": {
        "do_sample": True, "details": True}})
    assert isinstance(b["details"]["seed"], int)
    assert h["x-seed"] == str(b["details"]["seed"])
    _, b, _ = await call(fake_server.url, "/generate", {"inputs": "hello", "parameters": {
        "top_k": 3, "seed": 1234, "details": True}})
    assert b["details"]["seed"] == 1234


async def test_best_of_returns_best_by_logprob(fake_server):
    n_before = len(fake_server.engine.started)
    status, b, _ = await call(fake_server.url, "/generate", {"inputs": "hello world", "parameters": {
        "best_of": 2, "do_sample": True, "details": True}})
    assert status == 200, b
    started = fake_server.engine.started[n_before:]
    assert len(started) == 2 and started[0].sampling.seed != started[1].sampling.seed
    d = b["details"]
    assert len(d["best_of_sequences"]) == 1
    other = d["best_of_sequences"][0]
    assert set(other) >= {"generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    best_sum = sum(t["logprob"] for t in d["tokens"])
    other_sum = sum(t["logprob"] for t in other["tokens"])
    assert best_sum >= other_sum
    assert {d["seed"], other["seed"]} == {r.sampling.seed for r in started}


# --- streaming ---------------------------------------------------------------------------

async def test_generate_stream_events(fake_server, router_tokenizer):
    prompt = "東京 数据 😀 🎉"
    status, events, _ = await stream(fake_server.url, "/generate_stream", {
        "inputs": prompt, "parameters": {"max_new_tokens": 60, "top_n_tokens": 1}})
    assert status == 200, events
    ids = router_tokenizer.encode(prompt)
    assert [e["index"] for e in events] == list(range(1, len(ids) + 2))
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
        assert set(e) == {"index", "token", "top_tokens", "generated_text", "details"}
        assert "\ufffd" not in e["token"]["text"]
        assert len(e["top_tokens"]) == 1
    last = events[-1]
    assert last["generated_text"] == prompt
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": len(ids) + 1, "seed": None,
                               "input_length": len(ids)}
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == prompt


async def test_compat_route_streams_or_not(fake_server):
    status, body, _ = await call(fake_server.url, "/", {"inputs": "hello", "parameters": {"details": True}})
    assert status == 200 and isinstance(body, list) and body[0]["generated_text"] == "hello"
    status, events, _ = await stream(fake_server.url, "/", {"inputs": "hello", "stream": True})
    assert status == 200 and events[-1]["generated_text"] == "hello"
    status, body, _ = await call(fake_server.url, "/", {"inputs": "hello", "stream": "yes"})
    assert_error(status, body, 422, "validation", "`stream`")


async def test_invocations_dispatches_on_body(fake_server):
    url = fake_server.url
    status, body, _ = await call(url, "/invocations", {"inputs": "hello"})
    assert status == 200 and body[0]["generated_text"] == "hello"
    status, events, _ = await stream(url, "/invocations", {"inputs": "hello", "stream": True})
    assert status == 200 and events[-1]["generated_text"] == "hello"
    status, body, _ = await call(url, "/invocations", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["object"] == "chat.completion"
    status, body, _ = await call(url, "/invocations", {"prompt": "hello", "max_tokens": 3})
    assert status == 200 and body["object"] == "text_completion"


async def test_stream_error_before_and_after_first_token(fake_server):
    url = fake_server.url
    status, body, _ = await call(url, "/generate_stream", {"inputs": "FAIL:overloaded"})
    assert_error(status, body, 429, "overloaded", "overloaded")
    status, body, _ = await call(url, "/generate_stream", {"inputs": "FAIL:generation"})
    assert_error(status, body, 424, "generation")
    status, events, _ = await stream(url, "/generate_stream", {"inputs": "a b c d FAIL:after=2"})
    assert status == 200
    assert len(events) == 3 and "token" in events[0] and "token" in events[1]
    assert events[2]["error_type"] == "generation" and "mid-stream" in events[2]["error"]


async def test_closing_a_stream_closes_the_engine_request(fake_server):
    engine = fake_server.engine
    prompt = "HANG:2 disconnect-stream"
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.url + "/generate_stream",
                          json={"inputs": prompt, "parameters": {"max_new_tokens": 60}}) as r:
            assert r.status == 200
            got = 0
            while got < 2:
                line = await r.content.readline()
                if line.startswith(b"data: "):
                    got += 1
            r.close()  # the client goes away mid-stream
    await async_wait_for(lambda: any(q.inputs == prompt for q in engine.closed), what="engine request closed")
    assert not any(q.inputs == prompt for q in engine.finished)


async def test_cancelled_non_streaming_request_closes_the_engine_request(fake_server):
    engine = fake_server.engine
    prompt = "HANG:1 disconnect-generate"

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(fake_server.url + "/generate",
                              json={"inputs": prompt, "parameters": {"max_new_tokens": 60}}) as r:
                await r.read()

    task = asyncio.ensure_future(go())
    await async_wait_for(lambda: any(q.inputs == prompt for q in engine.started), what="request started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_wait_for(lambda: any(q.inputs == prompt for q in engine.closed), what="engine request closed")


# --- errors -------------------------------------------------------------------------------

BAD_PARAMETERS = [
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 1000}, "`inputs` tokens + `max_new_tokens` must be <= 128"),
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"top_p": 0.0}, "`top_p`"),
    ({"top_p": 1.1}, "`top_p`"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"typical_p": 1.0}, "`typical_p`"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"watermark": True}, "`watermark` is not supported"),
    ({"truncate": 65}, "`truncate` must be strictly positive and less than 64"),
    ({"max_new_tokens": "many"}, "`max_new_tokens`: expected an integer"),
]


@pytest.mark.parametrize("params, message", BAD_PARAMETERS)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_bad_parameters_are_422(fake_server, path, params, message):
    if path == "/generate_stream" and "best_of" in params:
        message = "`best_of`"
    status, body, _ = await call(fake_server.url, path, {"inputs": "hello world", "parameters": params})
    assert_error(status, body, 422, "validation", message)


@pytest.mark.parametrize("data, message", [
    (b"{not json", "Failed to parse the request body as JSON"),
    (b"\xff\xfe\x00", "invalid UTF-8"),
    (b"", "the body is empty"),
    (b'{"parameters": {}}', "missing field `inputs`"),
    (b'{"inputs": ""}', "`inputs` cannot be empty"),
    (b'{"inputs": 5}', "`inputs`: expected a string"),
    (b"[]", "expected a JSON object"),
    (b'{"inputs": "\\ud800"}', "tokenizer error"),  # a lone surrogate: valid JSON, not text
])
async def test_bad_bodies_are_422(fake_server, data, message):
    for path in ("/generate", "/generate_stream", "/"):
        status, body, _ = await call(fake_server.url, path, data=data,
                                     headers={"Content-Type": "application/json"})
        assert_error(status, body, 422, "validation", message)


async def test_long_inputs_and_truncate(fake_server, router_tokenizer):
    long = " ".join(["kubernetes"] * 80)
    n = len(router_tokenizer.encode(long))
    assert n > 64
    status, body, _ = await call(fake_server.url, "/generate", {"inputs": long})
    assert_error(status, body, 422, "validation", f"`inputs` must have less than 64 tokens. Given: {n}")
    status, body, _ = await call(fake_server.url, "/generate", {
        "inputs": long, "parameters": {"truncate": 10, "max_new_tokens": 12, "details": True}})
    assert status == 200, body
    assert fake_server.engine.finished[-1].input_ids == router_tokenizer.encode(long)[-10:]


async def test_engine_errors_map_to_status_codes(fake_server):
    url = fake_server.url
    for path, body in [("/generate", {"inputs": "FAIL:overloaded"}),
                       ("/v1/completions", {"prompt": "FAIL:overloaded"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL:overloaded"}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL:overloaded"}],
                                                 "stream": True})]:
        status, b, _ = await call(url, path, body)
        assert_error(status, b, 429, "overloaded")
    status, b, _ = await call(url, "/generate", {"inputs": "FAIL:generation"})
    assert_error(status, b, 424, "generation", "fake shard failure")
    status, b, _ = await call(url, "/generate", {"inputs": "a b FAIL:after=1"})
    assert_error(status, b, 424, "generation")
    # ...and the server keeps serving.
    status, b, _ = await call(url, "/generate", {"inputs": "hello"})
    assert status == 200 and b["generated_text"] == "hello"


# A body each route takes, to show that the rule does not depend on what is asked.
ROUTE_BODIES = {"/generate": {"inputs": "hello"}, "/generate_stream": {"inputs": "hello"}, "/": {"inputs": "hello"},
                "/invocations": {"inputs": "hello"}, "/tokenize": {"inputs": "hello"},
                "/v1/completions": {"prompt": "hello"},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}]},
                "/v1/responses": {"input": "hello"}}


async def _walk_routes(url: str) -> dict[str, tuple[int, object]]:
    from gaudi_runtime.router.routes import ROUTES

    out = {}
    for r in ROUTES:
        path = r.path.replace("{name}", "swagger-ui.css").replace("{response_id}", "resp_unknown")
        status, body, _ = await call(url, path, ROUTE_BODIES.get(r.path), method=r.method)
        out[r.path] = (status, body, r.open)
    return out


async def test_until_ready_every_route_but_the_open_ones_answers_503_with_the_warmup(make_server):
    """One readiness rule for the whole route table: a client probing /v1/models or /info learns
    that the server is warming up, as one sending /generate does."""
    keyed, s = make_server(API_KEY="k"), make_server()
    for server in (keyed, s):
        server.engine.healthy = False
        server.engine.health_body = {"status": "warming_up", "warmup": {"done": 3, "total": 10, "phase": "prefill"}}
    async with aiohttp.ClientSession() as session:
        async with session.get(keyed.url + "/v1/models") as r:
            assert r.status == 401  # the key is checked first: an unknown caller learns nothing more
    seen = await _walk_routes(s.url)
    for path, (status, body, is_open) in seen.items():
        if is_open:
            assert status == (503 if path == "/health" else 200), (path, status, body)
            continue
        assert status == 503, (path, status, body)
        if path.startswith("/v1/"):  # OpenAI's envelope, which has no room for the progress
            assert_openai_error(status, body, 503, "the server cannot serve requests yet (warming_up)")
            continue
        assert body == {"error": "the server cannot serve requests yet (warming_up)", "error_type": "unhealthy",
                        "warmup": {"done": 3, "total": 10, "phase": "prefill"}}, (path, body)
    assert seen["/health"][1] == {"status": "warming_up", "warmup": {"done": 3, "total": 10, "phase": "prefill"}}
    s.engine.health_body = {"status": "failed", "error": "shard 1 died"}  # failed: the same 503, no progress
    status, body, _ = await call(s.url, "/info", method="GET")
    assert_error(status, body, 503, "unhealthy", "failed")
    s.engine.healthy = True
    s.engine.health_body = {"status": "ready"}
    seen = await _walk_routes(s.url)
    # ready: every route answers, a stored response that is not there with its 404
    assert all(status == (404 if "{response_id}" in path else 200) for path, (status, _, _) in seen.items()), seen


# --- other TGI routes ----------------------------------------------------------------------

async def test_tokenize(fake_server, router_tokenizer):
    text = "hello world 東京"
    status, body, _ = await call(fake_server.url, "/tokenize", {"inputs": text})
    assert status == 200
    assert [t["id"] for t in body] == router_tokenizer.encode(text)
    assert "".join(t["text"] for t in body) == text
    for t in body:
        assert text[t["start"]:t["stop"]] == t["text"]
    status, body, _ = await call(fake_server.url, "/tokenize", {"inputs": ""})
    assert_error(status, body, 422, "validation")


async def test_info(fake_server):
    status, body, _ = await call(fake_server.url, "/info", method="GET")
    assert status == 200
    for k in ("model_id", "model_sha", "model_dtype", "model_device_type", "max_concurrent_requests",
              "max_best_of", "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
              "max_client_batch_size", "router", "version", "sha", "docker_label"):
        assert k in body, k
    assert body["model_id"] == "tiny-llama"
    assert (body["max_input_tokens"], body["max_total_tokens"], body["max_best_of"]) == (64, 128, 2)
    assert body["engine"] == "fake"  # the engine's info() is merged in


async def test_ping_models_and_unknown_route(fake_server):
    assert (await call(fake_server.url, "/ping", method="GET"))[0] == 200
    status, body, _ = await call(fake_server.url, "/v1/models", method="GET")
    assert status == 200 and body["object"] == "list" and body["data"][0]["id"] == "tiny-llama"
    assert (await call(fake_server.url, "/nope", {"inputs": "x"}))[0] == 404


async def test_metrics(make_server):
    s = make_server()
    await call(s.url, "/generate", {"inputs": "hello"})
    await stream(s.url, "/generate_stream", {"inputs": "hello world"})
    await call(s.url, "/generate", {"inputs": ""})
    await call(s.url, "/generate", {"inputs": "FAIL:overloaded"})
    status, text, headers = await call(s.url, "/metrics", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")

    def value(name: str, labels: str = "") -> float:
        m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name}{labels} not in\n{text}"
        return float(m.group(1))

    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}  # the exposition parses
    assert families["tgi_request_count"].type == "counter"
    assert value("tgi_request_count") == 4
    assert value("tgi_request_success") == 2
    assert value("tgi_request_failure", '{err="validation"}') == 1
    assert value("tgi_request_failure", '{err="overloaded"}') == 1
    assert value("tgi_request_generated_tokens_count") == 2
    assert value("tgi_request_duration_count") == 2
    assert value("tgi_request_input_length_count") == 3
    assert value("tgi_request_time_to_first_token_duration_count") == 2
    assert value("tgi_request_inter_token_latency_duration_count") > 0
    for name in ("tgi_request_queue_duration_count", "tgi_request_inference_duration_count",
                 "tgi_request_mean_time_per_token_duration_count", "tgi_request_max_new_tokens_count"):
        assert value(name) >= 2, name
    for name in ("tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens"):
        assert value(name) == 0
    assert "tgi_batch_inference_duration" in text and "tgi_batch_next_size" in text
    assert "tgi_request_count_total" not in text  # TGI's names, not prometheus_client's


async def test_engine_sets_metrics(make_server):
    s = make_server()
    s.metrics.tgi_batch_current_size.set(3)
    s.metrics.tgi_batch_inference_duration.labels(method="decode").observe(0.01)
    _, text, _ = await call(s.url, "/metrics", method="GET")
    assert re.search(r"^tgi_batch_current_size 3\.0$", text, re.M)
    assert 'tgi_batch_inference_duration_count{method="decode"} 1.0' in text


# --- API key and CORS ----------------------------------------------------------------------

async def test_api_key(make_server):
    s = make_server(API_KEY="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for path, body in [("/generate", {"inputs": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/info", None), ("/v1/models", None), ("/tokenize", {"inputs": "hi"})]:
            status, b, _ = await call(s.url, path, body, method="POST" if body else "GET", headers=headers)
            assert_error(status, b, 401, "authentication")
    auth = {"Authorization": "Bearer s3cret"}
    status, b, _ = await call(s.url, "/generate", {"inputs": "hi"}, headers=auth)
    assert status == 200 and b["generated_text"] == "hi"
    assert (await call(s.url, "/info", method="GET", headers=auth))[0] == 200
    for path in ("/health", "/ping", "/livez", "/metrics"):
        assert (await call(s.url, path, method="GET"))[0] == 200, path


async def test_cors(make_server):
    s = make_server(CORS_ALLOW_ORIGIN="https://a.example, https://b.example")
    status, _, h = await call(s.url, "/generate", {"inputs": "hi"}, headers={"Origin": "https://a.example"})
    assert status == 200 and h["Access-Control-Allow-Origin"] == "https://a.example"
    status, _, h = await call(s.url, "/generate_stream", {"inputs": "hi"}, headers={"Origin": "https://b.example"})
    assert status == 200 and h["Access-Control-Allow-Origin"] == "https://b.example"
    _, _, h = await call(s.url, "/generate", {"inputs": "hi"}, headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in h
    status, _, h = await call(s.url, "/generate", method="OPTIONS", headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert status == 204 and h["Access-Control-Allow-Origin"] == "https://a.example"
    assert "POST" in h["Access-Control-Allow-Methods"]


async def test_skip_tokenizer_mode(make_server):
    s = make_server(SKIP_TOKENIZER_IN_TGI="true")
    status, b, _ = await call(s.url, "/generate", {"inputs": "5,6,7", "parameters": {"max_new_tokens": 3}})
    assert status == 200 and b["generated_text"] == "5,6,7"
    status, b, _ = await call(s.url, "/generate", {"inputs": "hello"})
    assert_error(status, b, 422, "validation", "comma-separated token ids")


# --- OpenAI routes -------------------------------------------------------------------------

async def test_completions(fake_server):
    status, b, _ = await call(fake_server.url, "/v1/completions", {
        "model": "tiny-llama", "prompt": "hello world", "max_tokens": 1, "temperature": 0})
    assert status == 200, b
    assert b["object"] == "text_completion" and b["model"] == "tiny-llama"
    assert b["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert b["usage"]["completion_tokens"] == 1
    assert b["usage"]["total_tokens"] == b["usage"]["prompt_tokens"] + 1


async def test_completions_ignore_eos_generates_to_max_tokens(fake_server):
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
    _, b, _ = await call(fake_server.url, "/v1/completions", body)
    assert b["choices"][0]["finish_reason"] == "stop" and b["usage"]["completion_tokens"] < 6
    _, b, _ = await call(fake_server.url, "/v1/completions", {**body, "ignore_eos": True})
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 6
    status, b, _ = await call(fake_server.url, "/v1/completions", {**body, "ignore_eos": "yes"})
    assert_error(status, b, 422, "validation", "ignore_eos")


async def test_completions_prompt_list(fake_server):
    status, b, _ = await call(fake_server.url, "/v1/completions", {
        "prompt": ["hello", "the gaudi card", "東京"], "max_tokens": 20, "temperature": 0})
    assert status == 200, b
    assert [(c["index"], c["text"], c["finish_reason"]) for c in b["choices"]] == [
        (0, "hello", "stop"), (1, "the gaudi card", "stop"), (2, "東京", "stop")]
    status, b, _ = await call(fake_server.url, "/v1/completions", {"prompt": ["a"] * 5})
    assert_error(status, b, 422, "validation", "maximum client batch size (4)")
    status, events, _ = await stream(fake_server.url, "/v1/completions", {
        "prompt": ["hello", "the gaudi card"], "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    texts = {0: "", 1: ""}
    finishes = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: "hello", 1: "the gaudi card"} and finishes == {0: "stop", 1: "stop"}


async def test_completions_errors(fake_server):
    url = fake_server.url
    for body, message in [({}, "missing field `prompt`"), ({"prompt": ""}, "`inputs` cannot be empty"),
                          ({"prompt": "x", "max_tokens": 0}, "`max_new_tokens` must be strictly positive"),
                          ({"prompt": "x", "n": 17}, "`n` must be <= 16 (--max-n)"),
                          ({"prompt": "x", "best_of": 3}, "`best_of` must be <= 2 (--max-best-of)"),
                          ({"prompt": 3}, "`prompt` must be")]:
        status, b, _ = await call(url, "/v1/completions", body)
        assert_error(status, b, 422, "validation", message)


async def test_chat_completions(fake_server):
    body = {"model": "tiny-llama", "messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, b, _ = await call(fake_server.url, "/v1/chat/completions", body)
    assert status == 200, b
    assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
    (c,) = b["choices"]
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    assert c["finish_reason"] == "length"
    assert len(c["logprobs"]["content"]) == 5 and len(c["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert b["usage"]["completion_tokens"] == 5
    # The prompt is the tokenizer's chat template, tokenized without extra special tokens.
    req = fake_server.engine.finished[-1]
    assert req.inputs == "<s>system: be brief\n<s>user: hello\nassistant:"

    status, events, _ = await stream(fake_server.url, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == c["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_temperature_zero_is_greedy(fake_server):
    msgs = [{"role": "user", "content": "hello"}]
    for body, sample in [({"temperature": 0}, False), ({}, True), ({"temperature": 0.5}, True)]:
        status, _, _ = await call(fake_server.url, "/v1/chat/completions",
                                  {"messages": msgs, "max_tokens": 2, **body})
        assert status == 200
        assert fake_server.engine.finished[-1].sampling.do_sample is sample, body


async def test_openai_extensions_are_accepted_and_penalties_reach_the_engine(fake_server):
    body = {"messages": [{"role": "user", "content": "hello", "name": "ann"}], "max_tokens": 2, "temperature": 0,
            "presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1}, "user": "u",
            "parallel_tool_calls": False, "a_field_from_the_future": {"x": 1}}
    status, b, _ = await call(fake_server.url, "/v1/chat/completions", body)
    assert status == 200, b
    s = fake_server.engine.finished[-1].sampling
    assert (s.presence_penalty, s.generated_frequency_penalty, s.frequency_penalty) == (1.5, 0.5, 0.0)
    status, b, _ = await call(fake_server.url, "/v1/chat/completions", {**body, "presence_penalty": -3})
    assert_error(status, b, 422, "validation", "`presence_penalty` must be >= -2.0 and <= 2.0")


async def test_chat_errors(fake_server):
    url = fake_server.url
    for body, message in [
        ({}, "`messages`"), ({"messages": []}, "`messages`"), ({"messages": [{"content": "x"}]}, "`role`"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
         "`response_format.json_schema` is required"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "`tool_choice`: 'required' needs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6},
         "`top_logprobs` must be <= 5"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "`temperature`"),
    ]:
        status, b, _ = await call(url, "/v1/chat/completions", body)
        assert_error(status, b, 422, "validation", message)


async def test_tools_for_a_template_that_does_not_render_them_are_in_the_prompt(make_server):
    """The tiny model's template has no `tools`: they reach the model appended to the last message
    (TGI's tool prompt), and `required` still forces a call with the grammar."""
    server = make_server(MAX_INPUT_TOKENS="1000", MAX_TOTAL_TOKENS="1100")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "max_tokens": 2}
    for extra, kind in [({}, None), ({"tool_choice": "required"}, "structural_tag"),
                        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "structural_tag")]:
        status, b, _ = await call(server.url, "/v1/chat/completions", {**body, **extra})
        assert status == 200, b
        sent = server.engine.finished[-1]
        assert "x\n---\n" + json.dumps([tool]) + "\nTo call one of the functions above" in sent.inputs
        assert (sent.grammar.kind if sent.grammar else None) == kind
    status, b, _ = await call(server.url, "/v1/chat/completions", {**body, "tool_prompt": "Call f."})
    assert status == 200 and server.engine.finished[-1].inputs.endswith(json.dumps([tool]) + "\nCall f.\nassistant:")


async def test_concurrent_requests(fake_server):
    prompts = [f"hello world {w}" for w in ("the", "a", "deep", "model", "token", "batch", "cache", "東京")]
    results = await asyncio.gather(*(call(fake_server.url, "/generate", {"inputs": p}) for p in prompts))
    assert [b["generated_text"] for _, b, _ in results] == prompts


async def test_n_choices_are_gathered_in_order(fake_server):
    body = {"prompt": ["hello", "the gaudi card"], "n": 2, "max_tokens": 3, "seed": 1}
    status, b, _ = await call(fake_server.url, "/v1/completions", body)
    assert status == 200, b
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    started = fake_server.engine.finished[-4:]
    assert sorted(r.sampling.seed for r in started) == [1, 1, 2, 2]  # the client's seed, plus the choice's index
    prompt_tokens = sum(len(r.input_ids) for r in started) // 2
    assert b["usage"]["prompt_tokens"] == prompt_tokens  # each prompt counted once
    status, events, _ = await stream(fake_server.url, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "hello"}], "n": 3, "max_tokens": 2,
                                      "stream": True})
    assert status == 200
    finishes = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[:-1]
                if e["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}


async def test_disabled_grammar_support_is_tgis_422(make_server):
    url = make_server(DISABLE_GRAMMAR_SUPPORT="true").url
    for path, body, message in [
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a"}}},
         "grammar is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}},
         "`response_format`: grammar is not supported (--disable-grammar-support)"),
    ]:
        status, b, _ = await call(url, path, body)
        assert_error(status, b, 422, "validation", message)
