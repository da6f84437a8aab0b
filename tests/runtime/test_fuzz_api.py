"""The real server (launcher, shard, router on the tiny model) fuzzed from its own OpenAPI document.

schemathesis generates bodies for every documented route from /api-doc/openapi.json, valid ones and
ones that break the schema, and checks each answer: no 500, the status, media type and body
documented for it (streams event by event: each event's `data` against the events' models; every
/v1 error also against OpenAI's own error schema), no
request left hanging (each has a timeout). Besides the generated bodies, each route gets the bodies
of EXPLICIT every run: the answers random bodies rarely reach (several choices, log-probabilities,
best_of, streams with their usage chunk), checked the same way. Afterwards the server still serves
a normal request. Bounded: a fixed number of examples per route, derandomized, so a
CI run takes the same cases and about the same time;
`GAUDI_SERVE_FUZZ_EXAMPLES=500` makes a longer hunt, with new random cases each run.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, get_json, running

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GAUDI_SERVE_FUZZ_EXAMPLES", "25"))
HUNT = "GAUDI_SERVE_FUZZ_EXAMPLES" in os.environ
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
RUN = {"cases": 0, "by_status": {}, "started": None}

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "n": 2, "logprobs": True, "top_logprobs": 2,
        "max_tokens": 6}
COMPLETION = {"prompt": ["hello world", "the card"], "n": 2, "logprobs": 2, "echo": True, "max_tokens": 6}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}
TGI_STREAM = {"inputs": "hello world", "parameters": {"max_new_tokens": 6, "top_n_tokens": 2, "do_sample": True,
                                                       "seed": 1}}
EXPLICIT = {  # path -> bodies sent every run besides the generated ones
    "/generate": [{"inputs": "hello world", "parameters": {"max_new_tokens": 6, "details": True,
                                                           "decoder_input_details": True, "top_n_tokens": 2}},
                  {"inputs": "hello world", "parameters": {"max_new_tokens": 6, "best_of": 2, "do_sample": True,
                                                           "details": True, "top_n_tokens": 1}}],
    "/generate_stream": [TGI_STREAM],
    "/": [{**TGI_STREAM, "stream": True}, {"inputs": "hello", "parameters": {"details": True, "max_new_tokens": 4}}],
    "/v1/completions": [COMPLETION, {**COMPLETION, **USAGE}, {"prompt": "hello", "best_of": 2, "max_tokens": 4}],
    "/v1/chat/completions": [CHAT, {**CHAT, **USAGE}],
    "/invocations": [{**CHAT, **USAGE}, {**COMPLETION, **USAGE}, {**TGI_STREAM, "stream": True}],
    "/v1/responses": [{"input": "hello world", "max_output_tokens": 6},
                      {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                       "instructions": "be brief", "max_output_tokens": 6, "stream": True}],
}
# OpenAI's own schema of an error body (its API's `ErrorResponse`): every /v1 error must follow it.
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    # Short generations (at most 48 tokens in all): the cases are many, each one's answer is what counts.
    with running(model_dir, tmp_path_factory.mktemp("fuzz"), *SMALL_ARGS, "--max-input-tokens", "32",
                 "--max-total-tokens", "48", env=SMALL_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server.url + "/api-doc/openapi.json")


def _cases() -> list:
    """Every documented route of the table; those with a body also with bodies that break its schema."""
    from gaudi_runtime.router.routes import ROUTES

    modes = {True: [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], False: [GenerationMode.POSITIVE]}
    return [pytest.param(r.method, r.path, mode, id=f"{r.method} {r.path} {mode}")
            for r in ROUTES if r.documented for mode in modes[bool(r.bodies)]]


@pytest.mark.parametrize("method, path, mode", _cases())
def test_every_documented_route_answers_within_its_contract(api_schema, method, path, mode):
    operation = api_schema[path][method]
    RUN["started"] = RUN["started"] or time.monotonic()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not HUNT, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def call_and_check(case):
        response = case.call(timeout=60)
        RUN["cases"] += 1
        key = (f"{method} {path}", response.status_code, response.headers.get("content-type", [""])[0].split(";")[0])
        RUN["by_status"][key] = RUN["by_status"].get(key, 0) + 1
        case.validate_response(response, checks=CHECKS)
        if path.startswith("/v1/") and response.status_code >= 400:
            jsonschema.validate(response.json(), OPENAI_ERROR)

    if mode == GenerationMode.POSITIVE:
        for body in EXPLICIT.get(path, ()):
            call_and_check = example(case=operation.Case(body=body, media_type="application/json"))(call_and_check)
    call_and_check()


def test_the_server_still_serves_after_the_fuzzing(fuzzed_server):
    elapsed = time.monotonic() - (RUN["started"] or time.monotonic())
    print(f"\nfuzz: {RUN['cases']} cases in {elapsed:.0f}s")
    for (route, status, media), n in sorted(RUN["by_status"].items()):
        print(f"  {route:28} {status} {media:20} {n}")
    code, health = get_json(fuzzed_server.url + "/health")
    assert code == 200, health
    req = urllib.request.Request(fuzzed_server.url + "/generate", data=json.dumps(
        {"inputs": "hello world", "parameters": {"max_new_tokens": 5}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and "generated_text" in json.loads(r.read())
    assert fuzzed_server.proc.poll() is None
