"""Tool calls in each model family's format: recognising the format, parsing whole outputs and
streaming them as OpenAI's deltas (which, joined, give the whole parse)."""

from __future__ import annotations

import json

import pytest

from gaudi_runtime.router.tool_calls import ToolCallStream, detect_format, parse, renders_tools
from gaudi_runtime.tools.tiny_model import CHAT_TEMPLATE, CHAT_TEMPLATES

ARGS = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" }{ brace"}
CALL = {"name": "get_weather", "arguments": ARGS}

OUTPUTS = {  # format -> (output with two calls after some text, output with text only)
    "hermes": ("Let me check.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>\n<tool_call>\n"
               + json.dumps({**CALL, "name": "get_time"}) + "\n</tool_call>", "Hello <b>there</b>"),
    "mistral": ("Let me check.[TOOL_CALLS] [" + json.dumps(CALL) + ", " + json.dumps({**CALL, "name": "get_time"})
                + "]", "Hello [there]"),
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": ARGS}) + "; "
                    + json.dumps({"name": "get_time", "parameters": ARGS}), "Hello {there}"),
    # DeepSeek-V3's template writes each call so (its chat_template, tokenizer_config.json)
    "deepseek_v3": ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    "```json\n" + json.dumps(ARGS) + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
                    "<｜tool▁sep｜>get_time\n```json\n" + json.dumps(ARGS) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "Hello ```json\n{}\n``` <｜there｜>"),
}
DEEPSEEK_TEMPLATE = ("{%- for m in messages %}{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{%- endif %}{%- endfor %}"
                     "<｜Assistant｜>")


def test_the_format_is_read_from_the_chat_template():
    assert detect_format(CHAT_TEMPLATES["qwen2"]) == "hermes"
    assert detect_format(CHAT_TEMPLATES["mistral"]) == "mistral"
    assert detect_format(CHAT_TEMPLATES["llama31"]) == "llama3_json"
    assert detect_format(DEEPSEEK_TEMPLATE) == "deepseek_v3"
    assert detect_format(CHAT_TEMPLATE) is None
    assert detect_format(CHAT_TEMPLATE, "hermes") == "hermes"  # --tool-call-parser wins


def test_a_template_renders_tools_when_it_uses_the_variable():
    assert all(renders_tools(t) for t in CHAT_TEMPLATES.values())
    assert not renders_tools(CHAT_TEMPLATE) and not renders_tools(None)
    assert renders_tools("{% if tools is not defined %}{% set tools = none %}{% endif %}{{ tools }}")
    assert not renders_tools("{# no tools here #}{% set tools = [] %}{{ messages }}")  # named, never read
    assert renders_tools("{% generation %}{{ tools }}{% endgeneration %}")  # tags jinja alone cannot parse


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_whole_outputs_parse_into_calls_and_content(fmt):
    calls_text, plain = OUTPUTS[fmt]
    p = parse(fmt, calls_text, final=True)
    assert [c.name for c in p.calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in p.calls] == [ARGS, ARGS]
    assert p.content.strip() == ("" if fmt == "llama3_json" else "Let me check.")
    p = parse(fmt, plain, final=True)
    assert p.calls == [] and p.content == plain


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("which", [0, 1])
def test_streamed_deltas_add_up_to_the_whole_parse(fmt, which):
    text = OUTPUTS[fmt][which]
    whole = parse(fmt, text, final=True)
    stream = ToolCallStream(fmt)
    content, calls = "", {}
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        for d in stream.add(piece, final=k == len(pieces) - 1):
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:
                    assert c["index"] == len(calls) and c["type"] == "function"
                    calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]
    assert stream.called == bool(whole.calls)


def test_a_call_cut_short_keeps_its_name_and_the_arguments_so_far():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    (call,) = parse("hermes", text, final=True).calls
    assert (call.name, call.arguments, call.end) == ("get_weather", '{"city": "Pa', None)


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_calls_before_one_cut_short_at_its_start_are_kept(fmt):
    text = OUTPUTS[fmt][0]
    cut = text[:text.index("get_time") - 4]  # the second call has begun, its name not yet written
    p = parse(fmt, cut, final=True)
    assert [c.name for c in p.calls if c.name is not None] == ["get_weather"]


def test_a_marker_being_written_is_held_back_until_it_is_one():
    s = ToolCallStream("hermes")
    assert s.add("Hi <tool") == [{"content": "Hi "}]
    (d,) = s.add('_call>\n{"name": "f"')
    (call,) = d["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": ""} and call["id"].startswith("chatcmpl-tool-")
    s = ToolCallStream("hermes")
    s.add("Hi <tool")
    assert s.add("box>") == [{"content": "<toolbox>"}]


def test_deepseek_calls_stream_their_arguments_as_they_grow():
    s = ToolCallStream("deepseek_v3")
    assert s.add("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_") == []
    named, args = s.add("weather\n```json\n{\"city\": ")
    assert named["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert args["tool_calls"][0]["function"] == {"arguments": '{"city": '}
    (d,) = s.add('"Par')
    assert d["tool_calls"][0]["function"] == {"arguments": '"Par'}
    (d,) = s.add('is"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', final=True)
    assert d["tool_calls"][0]["function"] == {"arguments": 'is"}'}


def test_arguments_given_as_a_json_string_are_decoded():
    text = '[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]'
    (call,) = parse("mistral", text, final=True).calls
    assert json.loads(call.arguments) == {"a": 1}


def test_llama_text_that_is_no_call_is_content():
    assert parse("llama3_json", '{"answer": 42}', final=True).content == '{"answer": 42}'
    assert parse("llama3_json", '{"answer": 4', final=False).content == ""  # might still be a call


def test_the_readme_quotes_the_instruction_the_model_sees():
    from pathlib import Path

    from gaudi_runtime.router.tool_calls import default_tool_prompt

    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert default_tool_prompt("llama3_json") in readme
