"""The agent frameworks users put in front of an OpenAI-compatible server, unchanged, against the
real runtime on loopback: LangChain (`langchain-openai`), LiteLLM and the OpenAI Agents SDK.

Each does a tool call, a structured output and meets an error the way the framework surfaces it
(LangChain's `ContextOverflowError`, LiteLLM's `ContextWindowExceededError`, the `openai` error the
Agents SDK lets through). The weights are random, so tool calls are forced (`tool_choice`
`required`: the grammar makes the call follow the tool's parameters) and the parameters are enums,
which keeps every answer short and its content certain; text is greedy. One server for the module.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import running

pytestmark = pytest.mark.slow

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its cost map from the package
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no trace export (no network)

# Room for the tool prompt (about 350 tokens of the tiny tokenizer) and a few turns.
ARGS = ["--dtype", "float32", "--max-input-tokens", "1024", "--max-total-tokens", "1280",
        "--max-batch-prefill-tokens", "2048", "--max-batch-size", "8"]
ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "128", "BATCH_BUCKET_SIZE": "8", "PREFILL_BATCH_BUCKET_SIZE": "4",
       "EXPONENTIAL_BUCKETING": "true", "WARMUP_ENABLED": "false"}
MODEL = "tiny"
TOO_LONG = "word " * 3000  # more than --max-input-tokens


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "London"]
    sunny: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("frameworks") / "llama", "llama")
    with running(model_dir, tmp_path_factory.mktemp("frameworks-run"), *ARGS, env=ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.url + "/v1"


def get_weather(city: Literal["Paris", "London"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


# --- LangChain -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(base_url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="-", temperature=0, max_tokens=8, max_retries=0,
                      timeout=120)


def test_langchain_bind_tools_forced_call(chat_model):
    from langchain_core.tools import tool

    answer = chat_model.bind_tools([tool(get_weather)], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?", max_tokens=120)
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "London"), answer
    assert call["id"] and answer.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_structured_output(chat_model):
    got = chat_model.with_structured_output(Weather, method="json_schema").invoke("Weather?", max_tokens=120)
    assert isinstance(got, Weather), got


def test_langchain_streaming_matches_invoke(chat_model):
    whole = chat_model.invoke("hello there")
    pieces = list(chat_model.stream("hello there"))
    assert len(pieces) > 1
    assert "".join(p.content for p in pieces) == whole.content


def test_langchain_context_overflow(chat_model):
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError, match="maximum context length"):
        chat_model.invoke(TOO_LONG)
    assert chat_model.invoke("hi").content is not None  # and the server keeps serving


# --- LiteLLM ---------------------------------------------------------------------------------------

def _litellm():
    import litellm

    litellm.telemetry = False
    return litellm


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "required": ["city"], "properties": {
                                             "city": {"type": "string", "enum": ["Paris", "London"]}}}}}


def test_litellm_tool_call(base_url):
    litellm = _litellm()
    r = litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key="-", max_tokens=120,
                           messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                           tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.prompt_tokens > 0


def test_litellm_structured_output_and_streaming(base_url):
    litellm = _litellm()
    common = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="-")
    r = litellm.completion(**common, max_tokens=120, messages=[{"role": "user", "content": "Weather?"}],
                           response_format=Weather)
    Weather.model_validate_json(r.choices[0].message.content)
    whole = litellm.completion(**common, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}])
    chunks = list(litellm.completion(**common, max_tokens=8, temperature=0, stream=True,
                                     messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_litellm_maps_our_errors(base_url):
    litellm = _litellm()
    common = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="-", max_tokens=4)
    with pytest.raises(litellm.ContextWindowExceededError, match="maximum context length"):
        litellm.completion(**common, messages=[{"role": "user", "content": TOO_LONG}])
    with pytest.raises(litellm.BadRequestError, match="temperature"):
        litellm.completion(**common, messages=[{"role": "user", "content": "hi"}], temperature=-1)


# --- OpenAI Agents SDK -------------------------------------------------------------------------------

def _agent(model, **kw):
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    return Agent(name="weather", instructions="Answer with the tool.", model=model,
                 tools=[function_tool(get_weather)], tool_use_behavior="stop_on_first_tool",
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120), **kw)


def _in_one_loop(base_url: str, api: str, body) -> None:
    """`await body(model)` with the SDK's model for `api` on a client opened and closed in one event
    loop (a client outliving its loop fails when it closes its connections)."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel
    from openai import AsyncOpenAI

    async def run():
        async with AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=120) as client:
            kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            await body(kind(MODEL, client))

    asyncio.run(run())


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_runs_a_function_tool(base_url, api):
    from agents import Runner

    async def body(model):
        result = await Runner.run(_agent(model), "What is the weather in Paris?")
        assert result.final_output in ("sunny in Paris", "sunny in London"), result
        calls = [i for i in result.new_items if i.type == "tool_call_item"]
        assert len(calls) == 1 and calls[0].raw_item.name == "get_weather"

    _in_one_loop(base_url, api, body)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_structured_output_and_error(base_url, api):
    import openai
    from agents import Agent, ModelSettings, Runner

    async def body(model):
        agent = Agent(name="typed", instructions="Say the weather.", model=model, output_type=Weather,
                      model_settings=ModelSettings(max_tokens=120))
        result = await Runner.run(agent, "Weather?")
        assert isinstance(result.final_output, Weather), result
        with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
            await Runner.run(agent, TOO_LONG)
        assert e.value.code == "context_length_exceeded"

    _in_one_loop(base_url, api, body)
