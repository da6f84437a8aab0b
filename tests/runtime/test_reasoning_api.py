"""Reasoning output through the HTTP API (--reasoning-parser), with the fake engine answering what
each test chooses (`REPLY<<text>>END`) and the `openai` client reading it: the thinking in
`reasoning`, the answer in `content`, whole and streamed; `.parse()` on an answer that thinks first;
a budget spent inside the thinking; tool calls read from the answer only, in Qwen3's (hermes) and
DeepSeek-V3's formats. Every answer is also checked against the server's OpenAPI document.

The tiny tokenizers get `<think>` and `</think>` as single tokens, as Qwen3's and DeepSeek-R1's
have, and chat templates that handle the thinking as theirs do (Qwen3's `enable_thinking`,
DeepSeek-R1's prompt ending in `<think>`)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.conftest import _serve
from tests.runtime.test_openapi import CheckedClient, _choices

QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
# DeepSeek-R1's shape: no tools rendered (they come in a prompt), calls in DeepSeek-V3's format, and
# the prompt opens the thinking.
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<｜Assistant｜>{%- if m.tool_calls %}<｜tool▁calls▁begin｜>"
    "{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>"
    "{%- else %}{{ m.content }}{%- endif %}<｜end▁of▁sentence｜>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>\n{%- endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _model(tmp_path_factory, name: str, template: str) -> str:
    """A tiny model whose tokenizer holds `<think>` and `</think>` as single tokens, with `template`."""
    from transformers import AutoTokenizer

    d = make_tiny_model(tmp_path_factory.mktemp(name) / name, "qwen2")
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    s = _serve(_model(tmp_path_factory, "qwen3", QWEN3_TEMPLATE), REASONING_PARSER="qwen3",
               MAX_INPUT_TOKENS="1500", MAX_TOTAL_TOKENS="2048")
    yield s
    s.thread.stop()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    s = _serve(_model(tmp_path_factory, "deepseek", DEEPSEEK_TEMPLATE), REASONING_PARSER="deepseek_r1",
               MAX_INPUT_TOKENS="1500", MAX_TOTAL_TOKENS="2048")
    yield s
    s.thread.stop()


def client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)


def ask(reply: str) -> list[dict]:
    return [{"role": "user", "content": f"REPLY<<{reply}>>END"}]


def streamed(srv, **body) -> tuple[str, str, list]:
    """(reasoning, content, chunks) of a stream read with the `openai` client."""
    reasoning, content, chunks = "", "", []
    for chunk in client(srv).chat.completions.create(model="m", stream=True, **body):
        chunks.append(chunk)
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
    return reasoning, content, chunks


THOUGHT = "<think>\nThe user wants the weather. Paris is sunny.\n</think>\n\nIt is sunny in Paris."


def test_reasoning_and_answer_come_apart(qwen3):
    out = client(qwen3).chat.completions.create(model="m", messages=ask(THOUGHT), max_tokens=200)
    (choice,) = out.choices
    assert choice.message.reasoning == "\nThe user wants the weather. Paris is sunny.\n"
    assert choice.message.content == "It is sunny in Paris." and choice.finish_reason == "stop"
    reasoning, content, chunks = streamed(qwen3, messages=ask(THOUGHT), max_tokens=200)
    assert (reasoning, content) == (choice.message.reasoning, choice.message.content)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_generate_stays_raw_text(qwen3):
    r = httpx.post(qwen3.url + "/generate", json={"inputs": f"REPLY<<{THOUGHT}>>END",
                                                  "parameters": {"max_new_tokens": 200}}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == THOUGHT


def test_a_tgi_grammar_waits_for_the_thinking_too(qwen3):
    grammar = {"type": "regex", "value": "[a-z]+"}
    for inputs, gated in (("Think first.<think>\n", True), ("No thinking.<think>\n\n</think>\n\n", False)):
        r = httpx.post(qwen3.url + "/generate", timeout=60, json={
            "inputs": inputs, "parameters": {"max_new_tokens": 4, "grammar": grammar}})
        assert r.status_code == 200
        (started,) = [q for q in qwen3.engine.started if q.inputs == inputs][-1:]
        assert (started.grammar.thinking is not None) == gated and started.grammar.value == "[a-z]+"


def test_thinking_switched_off_is_all_answer(qwen3):
    reply = "No thinking </think> here."
    out = client(qwen3).chat.completions.create(model="m", messages=ask(reply), max_tokens=200,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == reply and out.choices[0].message.reasoning is None


def test_chat_template_kwargs_cannot_set_the_renderers_own_options(qwen3):
    r = httpx.post(qwen3.url + "/v1/chat/completions", timeout=60, json={
        "messages": ask("x"), "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]


class Weather(BaseModel):
    city: str
    days: int


def test_parse_reads_the_answer_after_the_thinking(qwen3):
    reply = "<think>\nI must answer in JSON: {not this}.\n</think>\n\n" + json.dumps({"city": "Paris", "days": 3})
    out = client(qwen3).chat.completions.parse(model="m", messages=ask(reply), max_tokens=300,
                                               response_format=Weather)
    msg = out.choices[0].message
    assert msg.parsed == Weather(city="Paris", days=3) and "{not this}" in msg.reasoning
    # the shard's grammar is told to wait for </think> (the prompt did not open the thinking)
    (started,) = [r for r in qwen3.engine.started if reply in r.inputs and r.grammar is not None][-1:]
    assert started.grammar.thinking[2] is False and started.grammar.thinking[:2] != (0, 0)


async def test_a_budget_spent_thinking_ends_with_length_and_no_answer(qwen3):
    reply = "<think>\nLet me think about this for a long time, step after step after step.</think>\n\n{}"
    body = {"messages": ask(reply), "max_tokens": 6, "response_format": {"type": "json_object"}}
    api = await CheckedClient.of(qwen3.url)
    (choice,) = (await api("/v1/chat/completions", body))["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"].startswith("\nLet")
    pieces = _choices(await api("/v1/chat/completions", {**body, "stream": True}))[0]
    assert not any("content" in p["delta"] for p in pieces) and pieces[-1]["finish_reason"] == "length"
    assert "".join(p["delta"].get("reasoning", "") for p in pieces) == choice["message"]["reasoning"]


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_qwen3_tool_calls_are_read_from_the_answer_only(qwen3):
    api = await CheckedClient.of(qwen3.url)
    reply = "<think>\nI could call " + WEATHER + " but I know it.\n</think>\n\nIt is sunny."
    (choice,) = (await api("/v1/chat/completions", {"messages": ask(reply), "tools": TOOLS}))["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny.", "reasoning": choice["message"]
                                 ["reasoning"]} and WEATHER in choice["message"]["reasoning"]
    reply = "<think>\nI need the weather.\n</think>\n\n" + WEATHER
    body = {"messages": ask(reply), "tools": TOOLS, "tool_choice": "required"}
    (choice,) = (await api("/v1/chat/completions", body))["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"] == "\nI need the weather.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    pieces = _choices(await api("/v1/chat/completions", {**body, "stream": True}))[0]
    assert "".join(p["delta"].get("reasoning", "") for p in pieces) == "\nI need the weather.\n"
    args = "".join(d["function"]["arguments"] for p in pieces for d in p["delta"].get("tool_calls", []))
    assert json.loads(args) == {"city": "Paris"} and pieces[-1]["finish_reason"] == "tool_calls"


DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def test_deepseek_thinks_from_the_first_token_and_calls_in_its_format(deepseek):
    reply = "The user asks about Paris.\n</think>\n\n" + DS_CALL
    out = client(deepseek).chat.completions.create(model="m", messages=ask(reply), tools=TOOLS, max_tokens=300)
    msg = out.choices[0].message
    assert msg.reasoning == "The user asks about Paris.\n" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert out.choices[0].finish_reason == "tool_calls"
    reasoning, content, chunks = streamed(deepseek, messages=ask(reply), tools=TOOLS, max_tokens=300)
    assert reasoning == msg.reasoning and content == ""
    args = "".join(t.function.arguments or "" for c in chunks for ch in c.choices for t in ch.delta.tool_calls or [])
    assert json.loads(args) == {"city": "Paris"}


def test_deepseek_grammar_waits_for_the_prompts_open_thinking(deepseek):
    client(deepseek).chat.completions.create(model="m", messages=ask("hm</think>" + DS_CALL), tools=TOOLS,
                                             tool_choice="required", max_tokens=300)
    grammar = deepseek.engine.started[-1].grammar
    assert grammar.kind == "structural_tag" and "<｜tool▁calls▁begin｜>" in grammar.value
    assert grammar.thinking[2] is True  # the prompt opened it: no `<think>` comes first


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(qwen3):
    """`/v1/responses` on a reasoning model: a reasoning item, then the answer's message, whole and
    streamed (what the Agents SDK and `client.responses.create` read)."""
    out = client(qwen3).responses.create(model="m", input=f"REPLY<<{THOUGHT}>>END", max_output_tokens=200)
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message"], kinds
    assert "Paris is sunny" in out.output[0].content[0].text
    assert out.output_text == "It is sunny in Paris."
    events = list(client(qwen3).responses.create(model="m", input=f"REPLY<<{THOUGHT}>>END",
                                                 max_output_tokens=200, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris is sunny" in thought and answer == "It is sunny in Paris."
    assert events[-1].type == "response.completed"
