"""Structured output, tool calls and several choices, as clients use them, on the real runtime.

Random-weight tiny models with sampling on: whatever they generate, a constrained output follows its
JSON schema or regex, or ends with finish_reason length; with bounded schemas every one of 50 samples
follows it. Tool calls come back in OpenAI's shape (whole and streamed) from models whose chat
templates speak Llama 3.1's, Mistral's and Qwen2.5's (Hermes) formats, and from one whose template
does not render tools (they are given in a prompt, calls in Llama 3.1's JSON).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import aiohttp
import jiter  # reads unfinished JSON (it comes with `openai`)
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import launch

# Room for the tool prompts (Llama 3.1's template indents the tools' JSON: 1400 tokens of the tiny
# tokenizer); exponential buckets keep warmup short.
ARGS = ["--dtype", "float32", "--max-input-tokens", "1792", "--max-total-tokens", "2048",
        "--max-batch-prefill-tokens", "4096", "--max-batch-size", "16", "--max-n", "64", "--max-best-of", "4"]
ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "128", "BATCH_BUCKET_SIZE": "8", "PREFILL_BATCH_BUCKET_SIZE": "4",
       "EXPONENTIAL_BUCKETING": "true"}

# "llama": the plain template, which does not render tools
FAMILY_FORMAT = {"qwen2": "hermes", "mistral": "mistral", "llama31": "llama3_json", "llama": "llama3_json"}

BOUNDED = {
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size", "ok"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "enum": [1, 2, 3]},
        "ok": {"type": "boolean"}}},
    "lengths": {"type": "object", "additionalProperties": False, "required": ["name", "tags"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
    "nested": {"type": "object", "required": ["code", "items"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "required": ["k", "v"], "properties": {
                "k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}}}}}},
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["utc", "cet"]}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A real server per family, started when a test first needs it."""
    started = {}

    def get(family: str):
        if family not in started:
            d = make_tiny_model(tmp_path_factory.mktemp(family), family)
            srv = launch(d, tmp_path_factory.mktemp(f"{family}-run"), *ARGS, env=ENV)
            started[family] = srv
            srv.wait_ready()
        return started[family]

    yield get
    for srv in started.values():
        srv.stop()


@pytest.fixture(scope="module")
def qwen(servers):
    return servers("qwen2")


class _Client(OpenAI):
    """The `openai` client, its errors showing our whole body."""

    def _make_status_error(self, err_msg, *, body, response):
        return super()._make_status_error(f"{err_msg}: {body}", body=body, response=response)


def openai(srv) -> OpenAI:
    return _Client(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=300)


def follows(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)  # strict JSON: no raw control characters
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# --- JSON schemas and regexes ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_every_sample_of_a_bounded_schema_follows_it(qwen, name):
    schema = BOUNDED[name]
    r = openai(qwen).chat.completions.create(
        model="tgi", messages=ASK, n=50, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    assert len(r.choices) == 50 and [c.index for c in r.choices] == list(range(50))
    bad = [c.message.content for c in r.choices if c.finish_reason != "stop" or not follows(c.message.content, schema)]
    assert not bad, f"{len(bad)} of 50 broke the schema: {bad[:3]}"
    assert len({c.message.content for c in r.choices}) > 1  # each choice sampled with its own seed
    assert r.usage.prompt_tokens < r.usage.completion_tokens  # the prompt counted once, not 50 times


def test_openai_parse_returns_the_pydantic_model(qwen):
    class Answer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mood: Literal["happy", "sad"]
        score: Literal[1, 2, 3]
        words: list[Literal["x", "y"]] = Field(max_length=2)
        note: str = Field(max_length=6)

    r = openai(qwen).chat.completions.parse(model="tgi", messages=ASK, response_format=Answer, n=8, max_tokens=200)
    assert all(isinstance(c.message.parsed, Answer) for c in r.choices)


def follows_or_is_cut_short(choice, schema: dict) -> bool:
    """The output follows `schema` (it stopped), or `max_tokens` cut it short (finish_reason length)
    and it starts a document that can still follow it: no text after a whole document, and the
    members it has so far (jiter reads the unfinished JSON) have the schema's types."""
    text = choice.message.content or ""
    if choice.finish_reason == "stop":
        return follows(text, schema)
    try:
        _, end = json.JSONDecoder().raw_decode(text)
        if text[end:].strip():
            return False
    except ValueError:
        pass
    try:
        so_far = jiter.from_json(text.encode(), partial_mode="trailing-strings")
    except ValueError:
        return False
    members_to_come = {k: v for k, v in schema.items() if k != "required"}
    return choice.finish_reason == "length" and jsonschema.Draft202012Validator(members_to_come).is_valid(so_far)


def test_unbounded_outputs_follow_the_schema_or_end_with_length(qwen):
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "number"}},
              "required": ["text", "n"]}
    client = openai(qwen)
    for fmt, followed in (({"type": "json_schema", "json_schema": {"name": "free", "schema": schema}}, schema),
                          ({"type": "json_object"}, {"type": "object"})):
        r = client.chat.completions.create(model="tgi", messages=ASK, n=16, max_tokens=40, seed=3, response_format=fmt)
        bad = [(c.finish_reason, c.message.content) for c in r.choices if not follows_or_is_cut_short(c, followed)]
        assert not bad, f"{len(bad)} of 16 broke {fmt['type']}: {bad[:3]}"
    # The same request without the constraint (the same seeds): the outputs are no JSON objects, so
    # the grammar is what kept the ones above in.
    r = client.chat.completions.create(model="tgi", messages=ASK, n=16, max_tokens=40, seed=3)
    free = [c for c in r.choices if follows_or_is_cut_short(c, {"type": "object"})]
    assert len(free) <= 2, [c.message.content for c in free]


def test_vllm_guided_fields(qwen):
    client = openai(qwen)
    r = client.completions.create(model="tgi", prompt="Answer:", n=8, max_tokens=20,
                                  extra_body={"guided_choice": ["yes", "no", "it depends (maybe)"]})
    assert {c.text for c in r.choices} <= {"yes", "no", "it depends (maybe)"}
    assert all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="tgi", prompt="Code:", n=8, max_tokens=20,
                                  extra_body={"guided_regex": "[A-F]{2}-[0-9]{1,3}"})
    assert all(re.fullmatch("[A-F]{2}-[0-9]{1,3}", c.text) for c in r.choices)
    r = client.chat.completions.create(model="tgi", messages=ASK, n=4, max_tokens=100,
                                       extra_body={"guided_json": BOUNDED["enums"]})
    assert all(follows(c.message.content, BOUNDED["enums"]) for c in r.choices)


def test_tgi_clients_send_grammar(qwen):
    from huggingface_hub import InferenceClient
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    client = Client(qwen.url, timeout=120)
    for seed in range(4):
        r = client.generate("Describe:", max_new_tokens=100, do_sample=True, seed=seed,
                            grammar=Grammar(type=GrammarType.Json, value=BOUNDED["lengths"]))
        assert r.details.finish_reason.value == "eos_token" and follows(r.generated_text, BOUNDED["lengths"])
    tokens = list(client.generate_stream("Id:", max_new_tokens=20, do_sample=True,
                                         grammar=Grammar(type=GrammarType.Regex, value="[a-z]{3}-[0-9]{4}")))
    assert re.fullmatch("[a-z]{3}-[0-9]{4}", tokens[-1].generated_text)
    hub = InferenceClient(model=qwen.url, timeout=120)
    out = hub.text_generation("Id:", max_new_tokens=20, do_sample=True, details=True,
                              grammar={"type": "regex", "value": "(cat|dog)s?"})
    assert re.fullmatch("(cat|dog)s?", out.generated_text) and out.details.finish_reason == "eos_token"


def test_a_grammar_cut_short_by_max_new_tokens_ends_with_length(qwen):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    r = Client(qwen.url, timeout=120).generate(
        "Id:", max_new_tokens=3, do_sample=True, grammar=Grammar(type=GrammarType.Regex, value="[a-z]{20}"))
    assert r.details.finish_reason.value == "length" and r.details.generated_tokens == 3
    assert re.fullmatch("[a-z]+", r.generated_text)


def test_stop_sequences_end_a_constrained_output(qwen):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    r = Client(qwen.url, timeout=120).generate("Id:", max_new_tokens=40, do_sample=True, stop_sequences=["b"],
                                               grammar=Grammar(type=GrammarType.Regex, value="a{3}b{30}"))
    assert r.details.finish_reason.value == "stop_sequence" and r.generated_text == "aaab"


async def _post(session, url, path, body):
    async with session.post(url + path, json=body) as r:
        return r.status, await r.json()


async def test_mixed_batches_keep_every_request_right(qwen):
    """Constrained and unconstrained requests, different grammars, joining and leaving one running
    batch: every constrained one follows its grammar, and a greedy unconstrained one gives the same
    text as alone."""
    url = qwen.url
    greedy = {"inputs": "the gaudi card", "parameters": {"max_new_tokens": 60, "ignore_eos": True}}
    regex = "[0-9]{2}(-[a-c]{2}){1,3}"
    constrained = [
        ({"inputs": "a", "parameters": {"max_new_tokens": 150, "do_sample": True,
                                        "grammar": {"type": "json", "value": BOUNDED[name]}}}, name)
        for name in sorted(BOUNDED)
    ] + [({"inputs": "b", "parameters": {"max_new_tokens": 30, "do_sample": True,
                                         "grammar": {"type": "regex", "value": regex}}}, "regex")] * 3
    async with aiohttp.ClientSession() as s:
        _, alone = await _post(s, url, "/generate", greedy)
        first = [asyncio.ensure_future(_post(s, url, "/generate", b)) for b, _ in constrained[:3]]
        running = asyncio.ensure_future(_post(s, url, "/generate", greedy))
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)  # some leave, then more join
        later = [asyncio.ensure_future(_post(s, url, "/generate", b)) for b, _ in constrained[3:]]
        results = await asyncio.gather(*first, *later)
        status, mixed = await running
    assert status == 200 and mixed["generated_text"] == alone["generated_text"]
    for (status, body), (_, name) in zip(results, constrained, strict=True):
        assert status == 200, body
        text = body["generated_text"]
        assert re.fullmatch(regex, text) if name == "regex" else follows(text, BOUNDED[name]), (name, text)


async def test_bad_constraints_are_refused_naming_the_field(qwen):
    chat = {"messages": ASK, "max_tokens": 5}
    cases = [
        ("/generate", {"inputs": "a", "parameters": {"grammar": {"type": "json", "value": {"type": 5}}}},
         "`grammar`: Type should be a string"),
        ("/generate", {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "(ab"}}},
         "`grammar`: Regex parsing error"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}}, "`response_format`: "),
        ("/v1/completions", {"prompt": "a", "guided_regex": "[a-"}, "`guided_regex`: "),
        ("/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                          "function": {"name": "nope"}}},
         "`tool_choice`: no function named 'nope' in `tools`"),
        ("/v1/chat/completions", {**chat, "n": 65}, "`n` must be <= 64 (--max-n). Given: 65"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "wat"}}}}}],
            "tool_choice": "required"}, "`tools`: "),
    ]
    async with aiohttp.ClientSession() as s:
        for path, body, message in cases:
            status, b = await _post(s, qwen.url, path, body)
            if path.startswith("/v1/"):  # OpenAI's envelope and status
                assert status == 400 and b["error"]["type"] == "BadRequestError" and message in b["error"]["message"]
            else:
                assert status == 422 and b["error_type"] == "validation" and message in b["error"], (body, b)
        # and the server keeps serving
        status, b = await _post(s, qwen.url, "/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2}})
        assert status == 200


# --- tool calls -------------------------------------------------------------------------------------

def _valid_calls(message) -> list:
    calls = message.tool_calls or []
    for c in calls:
        assert c.type == "function" and c.id
        assert jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name]) is None
    return calls


@pytest.mark.parametrize("family", sorted(FAMILY_FORMAT))
def test_tool_choice_required_and_named_make_valid_calls(servers, family):
    client = openai(servers(family))
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tgi", messages=ASK, tools=TOOLS, tool_choice=named, n=4,
                                       max_tokens=120)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert [t.function.name for t in _valid_calls(c.message)] == ["get_time"]
    r = client.chat.completions.create(model="tgi", messages=ASK, tools=TOOLS, tool_choice="required", n=4,
                                       max_tokens=120, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(_valid_calls(c.message)) == 1, c
    r = client.chat.completions.create(model="tgi", messages=ASK, tools=TOOLS, tool_choice="required", n=4,
                                       max_tokens=300)
    for c in r.choices:  # one call or more; a random model may go on calling until max_tokens
        calls = c.message.tool_calls
        assert calls and calls[0].function.name in SCHEMAS
        if c.finish_reason == "tool_calls":
            _valid_calls(c.message)
        else:
            assert c.finish_reason == "length"


def _prompt_with_tools(model_dir, family: str) -> list[int]:
    """The tokens of ASK with TOOLS as the model should see them: rendered by its chat template, or,
    when the template does not render tools, appended to the last message with the default
    instruction; read with transformers, not the router."""
    from transformers import AutoTokenizer

    from gaudi_runtime.router.tool_calls import default_tool_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    if family == "llama":
        shown = "\n---\n" + json.dumps(TOOLS) + "\n" + default_tool_prompt(FAMILY_FORMAT[family])
        prompt = tok.apply_chat_template([{**ASK[0], "content": ASK[0]["content"] + shown}], tokenize=False,
                                         add_generation_prompt=True)
    else:
        prompt = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    return tok.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("family", sorted(FAMILY_FORMAT))
def test_tool_choice_auto_and_none(servers, family):
    """`auto`: the model sees the tools and nothing constrains it, so greedily it writes what the
    same prompt gives as a plain completion. `none`: it sees no tools, so it writes what the
    conversation without tools gives. A grammar on either, or tools shown for `none`, changes that."""
    srv = servers(family)
    client = openai(srv)
    greedy = {"model": "tgi", "temperature": 0, "max_tokens": 20}
    auto = client.chat.completions.create(messages=ASK, tools=TOOLS, **greedy).choices[0]
    plain = client.completions.create(prompt=_prompt_with_tools(srv.model_dir, family), **greedy).choices[0]
    assert (auto.message.content, auto.message.tool_calls, auto.finish_reason) == (plain.text, None,
                                                                                  plain.finish_reason)
    none = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", **greedy).choices[0]
    bare = client.chat.completions.create(messages=ASK, **greedy).choices[0]
    assert none.message.tool_calls is None and none.message.content == bare.message.content
    assert none.finish_reason == bare.finish_reason


@pytest.mark.parametrize("family", sorted(FAMILY_FORMAT))
def test_streamed_tool_calls_add_up_to_valid_calls(servers, family):
    client = openai(servers(family))
    calls: dict[tuple[int, int], dict] = {}
    finish = {}
    stream = client.chat.completions.create(model="tgi", messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                            parallel_tool_calls=False, max_tokens=120, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                call = calls.setdefault((c.index, t.index), {"id": None, "name": None, "arguments": ""})
                if t.id:
                    assert call["id"] is None and t.function.name  # id and name come once, first
                    call.update(id=t.id, name=t.function.name)
                call["arguments"] += t.function.arguments or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert sorted(calls) == [(0, 0), (1, 0), (2, 0)]
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("family", sorted(FAMILY_FORMAT))
def test_history_with_tool_calls_and_results_is_accepted(servers, family):
    client = openai(servers(family))
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    r = client.chat.completions.create(model="tgi", messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


# --- several choices and log-probabilities ------------------------------------------------------------

def test_choices_and_logprobs_on_chat(qwen):
    r = openai(qwen).chat.completions.create(model="tgi", messages=ASK, n=3, max_tokens=6, seed=11,
                                             logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == r.usage.completion_tokens // 3 or c.finish_reason == "stop"
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    again = openai(qwen).chat.completions.create(model="tgi", messages=ASK, n=3, max_tokens=6, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_best_of_on_completions_returns_the_n_best(qwen):
    r = openai(qwen).completions.create(model="tgi", prompt="the", n=2, best_of=4, max_tokens=5, logprobs=1)
    assert len(r.choices) == 2
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in r.choices]
    assert means == sorted(means, reverse=True)
