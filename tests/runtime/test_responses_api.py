"""`/v1/responses` through the `openai` client on the real runtime (a tiny Llama on loopback): whole
and streamed, function calls forced with `tool_choice` `required`, a JSON schema, a conversation of
three turns on `previous_response_id`, GET and DELETE of a stored response, and errors in OpenAI's
shape. Every answer is also checked against the OpenAPI document the server serves. The store's
bound and the reasoning items are checked on their pure parts.
"""

from __future__ import annotations

import json

import openai
import pytest

from gaudi_runtime.router.responses_convert import output_items
from gaudi_runtime.router.responses_store import ResponseStore
from gaudi_runtime.router.responses_stream import ResponsesStream
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import running
from tests.runtime.test_openapi import CheckedClient

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-input-tokens", "1024", "--max-total-tokens", "1280",
        "--max-batch-prefill-tokens", "2048", "--max-batch-size", "8"]
ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "128", "BATCH_BUCKET_SIZE": "8", "PREFILL_BATCH_BUCKET_SIZE": "4",
       "EXPONENTIAL_BUCKETING": "true", "WARMUP_ENABLED": "false"}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}}}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"],
          "properties": {"city": {"enum": ["Paris", "London"]}, "sunny": {"type": "boolean"}}}
ORDER = ["response.created", "response.in_progress", "response.output_item.added"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("responses") / "llama", "llama")
    with running(model_dir, tmp_path_factory.mktemp("responses-run"), *ARGS, env=ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_a_response_whole_and_streamed(client):
    whole = client.responses.create(model="tiny", input="hello there", max_output_tokens=8, temperature=0)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output[0].type == "message"
    assert whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    events = list(client.responses.create(model="tiny", input="hello there", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [*ORDER, "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_forced_function_call_whole_and_streamed(client):
    # One call (parallel_tool_calls false): how many a random model makes is otherwise up to its tokens,
    # which prefix caching's other reduction order may change between the two requests.
    common = dict(model="tiny", input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=120)
    whole = client.responses.create(**common)
    (call,) = [o for o in whole.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "London")
    assert call.call_id and whole.status == "completed"
    events = list(client.responses.create(**common, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ORDER and kinds[-3:] == ["response.function_call_arguments.done",
                                                  "response.output_item.done", "response.completed"], kinds
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments and done.name == "get_weather"
    assert json.loads(done.arguments)["city"] in ("Paris", "London")


def test_a_json_schema_output(client):
    r = client.responses.create(model="tiny", input="Weather?", max_output_tokens=120, text={"format": {
        "type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}})
    got = json.loads(r.output_text)
    assert got["city"] in ("Paris", "London") and isinstance(got["sunny"], bool)


def test_three_turns_on_previous_response_id_with_a_tool_result(client):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                    instructions="Use the tool.")
    (call,) = [o for o in first.output if o.type == "function_call"]
    second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    third = client.responses.create(model="tiny", previous_response_id=second.id, input="and tomorrow?",
                                    max_output_tokens=4)
    # each turn's prompt holds the turns before it
    alone = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert alone.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    assert third.previous_response_id == second.id
    assert client.responses.retrieve(third.id).output_text == third.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    # the later turns hold their whole conversation: they go on without the deleted one
    assert client.responses.create(model="tiny", previous_response_id=third.id, input="ok",
                                   max_output_tokens=2).usage.input_tokens > third.usage.input_tokens


def test_errors_are_openais(client):
    with pytest.raises(openai.NotFoundError, match="resp_nope") as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.responses.create(model="tiny", input="word " * 3000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model="tiny", input="x", max_output_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_nope")


async def test_every_answer_follows_the_document(server):
    api = await CheckedClient.of(server.url)
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}], "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 120}
    whole = await api("/v1/responses", body)
    events = await api("/v1/responses", {**body, "stream": True})
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][0]["type"] == \
        whole["output"][0]["type"] == "function_call"
    await api("/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True})
    await api(f"/v1/responses/{whole['id']}", method="GET")
    assert (await api(f"/v1/responses/{whole['id']}", method="DELETE"))["deleted"] is True
    for status, path, method, sent in ((404, f"/v1/responses/{whole['id']}", "GET", None),
                                       (400, "/v1/responses", "POST", {"input": []}),
                                       (400, "/v1/responses", "POST", {"input": "x", "text": {"format": {
                                           "type": "json_schema"}}})):
        assert (await api(path, sent, method=method, status=status))["error"]["message"]


# --- the pure parts: the store's bound, reasoning items -------------------------------------------

def test_the_store_keeps_the_latest_and_says_when_one_was_evicted():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid}, [])
    assert len(store) == 2 and store.get("c").response == {"id": "c"}
    with pytest.raises(Exception, match="was evicted: this server keeps only its 2 most recent") as e:
        store.get("a", "previous_response_id")
    assert e.value.status == 404 and e.value.code == "previous_response_not_found"


def test_a_reasoning_text_becomes_a_reasoning_item_first():
    """The chat message's reasoning (a reasoning parser's `reasoning`) is the first output item,
    whole and streamed."""
    items = output_items({"role": "assistant", "content": "4", "reasoning": "2+2 is 4"})
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "2+2 is 4"}]
    stream = ResponsesStream(lambda output, status, usage: {"output": output, "status": status})
    events = stream.delta({"reasoning": "2+2"}) + stream.delta({"reasoning": " is 4"}) + \
        stream.delta({"content": "4"})
    ended, final = stream.finish("completed", None)
    kinds = [e["type"] for e in events + ended]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.reasoning_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.reasoning_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "2+2 is 4"


def test_huggingface_hub_chat_client_shows_openais_error_message(server):
    """huggingface_hub reads `error` as text: OpenAI's envelope still puts the message in its exception."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    hf = InferenceClient(base_url=server.url, timeout=60)
    with pytest.raises(HfHubHTTPError, match="maximum context length is 1024 tokens"):
        hf.chat_completion([{"role": "user", "content": "word " * 3000}], max_tokens=2)
