"""Request validation: TGI's limits and messages, as pure functions."""

from __future__ import annotations

import json
import random
import re

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.validation import (
    best_of_requests,
    parse_json_body,
    validate_generate,
)


class WordTokenizer:
    """One token per whitespace-separated word: lengths are easy to reason about."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


TOK = WordTokenizer()


def cfg(**env):
    base = {"MODEL_ID": "m", "MAX_INPUT_TOKENS": "10", "MAX_TOTAL_TOKENS": "20", "MAX_BEST_OF": "2",
            "MAX_STOP_SEQUENCES": "2", "MAX_TOP_N_TOKENS": "3"}
    return resolve(None, {**base, **env})


def ok(parameters=None, inputs="a b c", stream=False, config=None, seed=0):
    body = {"inputs": inputs, "parameters": parameters or {}}
    config = config or cfg()
    return validate_generate(body, config.limits, config.structured_output, TOK, stream=stream,
                             rng=random.Random(seed))


def bad(parameters=None, inputs="a b c", stream=False, config=None) -> str:
    with pytest.raises(ValidationError) as e:
        ok(parameters, inputs, stream, config)
    return str(e.value)


def test_defaults_follow_tgi():
    job = ok()
    r = job.request
    assert job.best_of == 1
    assert r.input_ids == [1, 1, 1]
    assert r.stopping.max_new_tokens == 20 - 3  # max_total_tokens - input length
    assert r.stopping.stop_sequences == ()
    assert r.stopping.ignore_eos_token is False
    assert r.sampling.do_sample is False
    assert r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0 and r.sampling.top_k == 0
    assert r.details is False and r.decoder_input_details is False and r.top_n_tokens == 0


def test_all_parameters_pass_through():
    r = ok({"do_sample": True, "temperature": 0.5, "top_k": 10, "top_p": 0.9, "typical_p": 0.5,
            "repetition_penalty": 1.2, "frequency_penalty": 0.5, "max_new_tokens": 5, "seed": 42,
            "stop": ["x", "y"], "details": True, "decoder_input_details": True, "top_n_tokens": 3,
            "return_full_text": True}).request
    s = r.sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty,
            s.frequency_penalty, s.seed) == (True, 0.5, 10, 0.9, 0.5, 1.2, 0.5, 42)
    assert r.stopping.max_new_tokens == 5 and r.stopping.stop_sequences == ("x", "y")
    assert r.details and r.decoder_input_details and r.top_n_tokens == 3 and r.return_full_text


def test_sampling_knobs_imply_sampling_and_random_seed():
    for p in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.5}, {"typical_p": 0.5}, {"do_sample": True}):
        r = ok(p).request
        assert r.sampling.do_sample, p
    # A neutral value is not a warper: greedy stays greedy.
    assert ok({"temperature": 1.0}).request.sampling.do_sample is False
    # No seed given: a random one, different between requests.
    seeds = {ok({"do_sample": True}, seed=i).request.sampling.seed for i in range(5)}
    assert len(seeds) == 5
    assert ok({"do_sample": True, "seed": 7}).request.sampling.seed == 7


def test_null_parameters_are_absent():
    # The text-generation client sends every field, most of them null.
    r = ok({"best_of": None, "temperature": None, "top_k": None, "top_p": None, "typical_p": None,
            "truncate": None, "seed": None, "top_n_tokens": None, "grammar": None, "max_new_tokens": None,
            "watermark": False, "stop": [], "adapter_id": None}).request
    assert r.sampling.do_sample is False


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": -3}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 18}, "`inputs` tokens + `max_new_tokens` must be <= 20. Given: 3 `inputs` tokens and 18 `max_new_tokens`"),
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, "`temperature` must be strictly positive"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": -1}, "`top_k` must be strictly positive"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"stop": ["a", "b", "c"]}, "`stop` supports up to 2 stop sequences. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 4}, "`top_n_tokens` must be >= 0 and <= 3. Given: 4"),
    ({"watermark": True}, "`watermark` is not supported"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 10. Given: 0"),
    ({"truncate": 11}, "`truncate` must be strictly positive and less than 10. Given: 11"),
    ({"seed": -1}, "`seed`"),
    ({"max_new_tokens": "ten"}, "`max_new_tokens`: expected an integer"),
    ({"max_new_tokens": 1.5}, "`max_new_tokens`: expected an integer"),
    ({"do_sample": "yes"}, "`do_sample`: expected a boolean"),
    ({"temperature": "hot"}, "`temperature`: expected a number"),
    ({"stop": "x"}, None),  # a single string is accepted as one stop sequence
])
def test_parameter_errors(params, message):
    if message is None:
        assert ok(params).request.stopping.stop_sequences == ("x",)
        return
    assert message in bad(params)


def test_top_p_one_means_off():
    assert ok({"top_p": 1.0}).request.sampling.top_p == 1.0


def test_inputs_errors():
    with pytest.raises(ValidationError, match="missing field `inputs`"):
        validate_generate({"parameters": {}}, cfg().limits, cfg().structured_output, TOK)
    assert bad(inputs="") == "`inputs` cannot be empty"
    assert "expected a string" in bad(inputs=["a"])
    with pytest.raises(ValidationError, match="`parameters`: expected an object"):
        validate_generate({"inputs": "a", "parameters": [1]}, cfg().limits, cfg().structured_output, TOK)


def test_input_length_and_truncate():
    long = " ".join(["w"] * 12)
    assert bad(inputs=long) == "`inputs` must have less than 10 tokens. Given: 12"
    r = ok({"truncate": 4}, inputs="a bb ccc dddd eeeee ffffff").request
    assert r.input_ids == [3, 4, 5, 6]  # the last `truncate` tokens
    assert r.inputs == "a bb ccc dddd eeeee ffffff"
    assert r.stopping.max_new_tokens == 16
    r = ok({"truncate": 9}, inputs=long).request  # truncation makes a long prompt fit
    assert len(r.input_ids) == 9


def test_stream_restrictions():
    assert bad({"best_of": 2, "do_sample": True}, stream=True) == "`best_of` != 1 is not supported when streaming tokens"
    assert bad({"decoder_input_details": True}, stream=True) == (
        "`decoder_input_details` == true is not supported when streaming tokens")


def test_disabled_limits():
    assert bad({"best_of": 2, "do_sample": True}, config=cfg(MAX_BEST_OF="1")) == (
        "`best_of` != 1 is not allowed for this endpoint")
    assert "`--max-top-n-tokens` is set to 0" in bad({"top_n_tokens": 1}, config=cfg(MAX_TOP_N_TOKENS="0"))


def test_ignore_eos_from_environment():
    r = ok(config=cfg(TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN="true")).request
    assert r.stopping.ignore_eos_token is True


def test_best_of_requests_get_distinct_seeds():
    job = ok({"best_of": 2, "do_sample": True})
    assert job.best_of == 2
    reqs = best_of_requests(job, random.Random(1))
    assert len(reqs) == 2 and reqs[0].sampling.seed != reqs[1].sampling.seed
    assert all(r.sampling.do_sample for r in reqs)
    assert best_of_requests(ok()) == [ok().request]


@pytest.mark.parametrize("raw, message", [
    (b"", "the body is empty"),
    (b"{not json", "Failed to parse the request body as JSON"),
    (b"\xff\xfe{}", "invalid UTF-8"),
    (b"[1, 2]", "expected a JSON object"),
    (b'"inputs"', "expected a JSON object"),
])
def test_parse_json_body_errors(raw, message):
    with pytest.raises(ValidationError, match=message):
        parse_json_body(raw)


def test_parse_json_body_ok():
    assert parse_json_body('{"inputs": "東京"}'.encode()) == {"inputs": "東京"}


# --- the request models: what a body may hold, and how a broken one is named -----------------------

def test_unknown_fields_are_ignored_and_null_is_absent():
    # Clients send extensions (vLLM's, newer TGI's) and null for every unset parameter.
    r = validate_generate({"inputs": "a b", "parameters": {"details": None, "stop": None, "some_new_knob": 3},
                           "extra": True}, cfg().limits, cfg().structured_output, TOK).request
    assert r.details is False and r.stopping.stop_sequences == ()


def test_json_numbers_are_typed_as_tgi_does():
    assert ok({"max_new_tokens": 5.0}).request.stopping.max_new_tokens == 5  # JSON has one number type
    assert ok({"temperature": 1}).request.sampling.temperature == 1.0
    for params, message in [({"max_new_tokens": "5"}, "`max_new_tokens`: expected an integer"),
                            ({"max_new_tokens": True}, "`max_new_tokens`: expected an integer"),
                            ({"temperature": True}, "`temperature`: expected a number"),
                            ({"temperature": float("nan")}, "`temperature`: expected a finite number"),
                            ({"stop": ["a", 1]}, "`stop` must be a string or a list of strings"),
                            ({"grammar": {"type": "yaml", "value": ""}}, "`grammar.type`: expected 'json' or 'regex'")]:
        assert message in bad(params), params


def _openai(model, body: dict, tokenizer=TOK, config=None):
    from gaudi_runtime.router.openai_validation import completion_requests
    from gaudi_runtime.router.request_models import parse_request

    config = config or cfg()
    return completion_requests(parse_request(model, body), config.limits, config.structured_output, tokenizer)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "a", "presence_penalty": 2.5}, "`presence_penalty` must be >= -2.0 and <= 2.0. Given: 2.5"),
    ({"prompt": "a", "frequency_penalty": "high"}, "`frequency_penalty`: expected a number"),
    ({"prompt": "a", "temperature": -0.5}, "`temperature` must be >= 0.0"),
    ({"prompt": "a", "stream_options": {"include_usage": "yes"}}, "`stream_options.include_usage`: expected a boolean"),
    ({"prompt": [], "max_tokens": 1}, "`prompt` must be a string, a non-empty list of strings, or a list of token ids"),
    ({"prompt": "a", "logprobs": -1}, "`logprobs` must be >= 0"),
    ({"prompt": "a", "max_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"prompt": "a", "best_of": 3}, "`best_of` must be <= 2 (--max-best-of). Given: 3"),
    ({"prompt": "a", "n": 3, "best_of": 2}, "`best_of` must be >= `n`. Given: best_of 2, n 3"),
    ({"prompt": "a", "n": 17}, "`n` must be <= 16 (--max-n). Given: 17"),
    ({"prompt": "a", "n": 0}, "`n` must be strictly positive"),
    ({"prompt": "a", "logprobs": 4}, "`logprobs` must be <= 3 (--max-top-n-tokens). Given: 4"),
    ({"prompt": "a", "guided_json": "{", "max_tokens": 1}, "`guided_json`: not valid JSON"),
    ({"prompt": "a", "guided_json": {}, "guided_regex": "a", "max_tokens": 1},
     "`guided_regex`: give only one of guided_json, guided_regex"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}, "max_tokens": 1},
     "`response_format.json_schema` is required when `response_format.type` is json_schema"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "`response_format.json_schema.schema` must be a JSON schema (an object)"),
    ({"prompt": "a", "guided_choice": []}, "`guided_choice` must not be empty"),
])
def test_completion_errors_name_the_field(body, message):
    from gaudi_runtime.router.request_models import CompletionRequest

    with pytest.raises(ValidationError) as e:
        _openai(CompletionRequest, body)
    assert message in str(e.value)


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user"}, {"content": "x"}]}, "missing field `role` in `messages[1]`"),
    ({"messages": [{"role": "user", "content": 5}]}, "`messages[0].content` must be a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
     "`messages[0].content[0].image_url` must be an object with a string `url`, or a URL"),
    ({"messages": [{"role": "user"}], "tool_choice": {"type": "function", "function": {}}},
     "missing field `name` in `tool_choice.function`"),
    ({"messages": [{"role": "user"}], "tool_choice": "sometimes"}, "`tool_choice` must be `none`, `auto`, `required`"),
    ({"messages": [{"role": "user"}], "top_logprobs": 1.5}, "`top_logprobs`: expected an integer"),
])
def test_chat_errors_name_the_field(body, message):
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    with pytest.raises(ValidationError) as e:
        parse_request(ChatCompletionRequest, body)
    assert message in str(e.value)


def test_openai_penalties_keep_openais_meaning():
    from gaudi_runtime.router.request_models import CompletionRequest

    (r,) = _openai(CompletionRequest, {"prompt": "a b", "frequency_penalty": 0.5, "presence_penalty": -1,
                                       "logit_bias": {"1": 5}, "user": "u"})
    s = r.sampling
    assert (s.generated_frequency_penalty, s.presence_penalty, s.frequency_penalty) == (0.5, -1.0, 0.0)
    # TGI's own frequency_penalty (over the prompt too) is the /generate parameter
    s = ok({"frequency_penalty": 0.5}).request.sampling
    assert (s.generated_frequency_penalty, s.presence_penalty, s.frequency_penalty) == (0.0, 0.0, 0.5)


def test_every_route_body_has_a_json_schema():
    from gaudi_runtime.router.routes import LORA_ROUTES, ROUTES

    bodies = {m for r in ROUTES + LORA_ROUTES for m in r.bodies}
    assert {m.__name__ for m in bodies} == {"GenerateRequest", "CompletionRequest", "ChatCompletionRequest",
                                            "TokenizeRequest", "ResponsesRequest", "LoadLoraAdapterRequest",
                                            "UnloadLoraAdapterRequest"}
    for model in bodies:
        schema = model.model_json_schema()
        assert schema["type"] == "object" and schema["properties"], model


# --- constrained generation, choices, tools ---------------------------------------------------------

def test_tgi_grammar_becomes_the_shards_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = ok({"grammar": {"type": "json", "value": schema}}).request.grammar
    assert (g.kind, json.loads(g.value), g.field) == ("json", schema, "grammar")
    # TGI's clients may send the schema as JSON text
    assert ok({"grammar": {"type": "json", "value": json.dumps(schema)}}).request.grammar == g
    g = ok({"grammar": {"type": "regex", "value": "[a-z]+"}}).request.grammar
    assert (g.kind, g.value) == ("regex", "[a-z]+")
    assert ok().request.grammar is None
    # a grammar's end is the output's end, whatever ignore_eos says
    assert not ok({"grammar": {"type": "regex", "value": "a"}, "ignore_eos": True}).request.stopping.ignore_eos_token


@pytest.mark.parametrize("params, message", [
    ({"grammar": {"type": "json", "value": "{nope"}}, "`grammar.value`: not valid JSON"),
    ({"grammar": {"type": "json", "value": "[1]"}}, "`grammar.value`: a JSON schema must be an object"),
    ({"grammar": {"type": "regex", "value": {"a": 1}}}, "`grammar.value`: a regex grammar's value must be a string"),
    ({"grammar": {"type": "json", "value": 5}}, "`grammar.value` must be a JSON schema"),
    ({"grammar": {"type": "json"}}, "missing field `value` in `grammar`"),
])
def test_bad_grammars_name_the_field(params, message):
    assert message in bad(params)


def test_disabled_grammar_support_is_tgis_422():
    off = cfg(DISABLE_GRAMMAR_SUPPORT="true")
    assert bad({"grammar": {"type": "regex", "value": "a"}}, config=off) == "grammar is not supported"
    from gaudi_runtime.router.request_models import CompletionRequest

    for field, value in [("response_format", {"type": "json_object"}), ("guided_regex", "a"),
                         ("guided_choice", ["a"]), ("guided_json", {})]:
        with pytest.raises(ValidationError) as e:
            _openai(CompletionRequest, {"prompt": "a", field: value, "max_tokens": 1}, config=off)
        assert str(e.value) == f"`{field}`: grammar is not supported (--disable-grammar-support)"


def test_openai_constraints_become_grammars():
    from gaudi_runtime.router.request_models import CompletionRequest

    def grammar(**fields):
        (r,) = _openai(CompletionRequest, {"prompt": "a", "max_tokens": 1, **fields})
        return r.grammar

    assert grammar() is None and grammar(response_format={"type": "text"}) is None
    g = grammar(response_format={"type": "json_object"})
    assert (g.kind, json.loads(g.value), g.field) == ("json", {"type": "object"}, "response_format")
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}}
    g = grammar(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert (json.loads(g.value), g.field) == (schema, "response_format")
    assert json.loads(grammar(guided_json=json.dumps(schema)).value) == schema
    assert grammar(guided_regex="[0-9]+").value == "[0-9]+"
    g = grammar(guided_choice=["yes", "no (maybe).", 'a"b'])
    assert g.kind == "regex" and g.field == "guided_choice"
    assert g.value == '(yes|no \\(maybe\\)\\.|a\\"b)'


def test_n_choices_are_ordinary_requests_with_seeds_of_their_own():
    from gaudi_runtime.router.request_models import CompletionRequest

    reqs = _openai(CompletionRequest, {"prompt": ["a", "b c"], "n": 3, "seed": 7, "max_tokens": 2})
    assert [r.inputs for r in reqs] == ["a"] * 3 + ["b c"] * 3
    assert [r.sampling.seed for r in reqs] == [7, 8, 9] * 2  # reproducible with a client seed
    reqs = _openai(CompletionRequest, {"prompt": "a", "n": 4, "max_tokens": 2})
    assert len({r.sampling.seed for r in reqs}) == 4
    # best_of: that many sequences, the n best are returned
    assert len(_openai(CompletionRequest, {"prompt": "a", "n": 1, "best_of": 2, "max_tokens": 2})) == 2


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}<tool_call>"


def _chat_tools(body: dict, template: str | None = HERMES_TEMPLATE, config=None):
    from gaudi_runtime.router.openai_validation import chat_tools
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    return chat_tools(parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body}),
                      (config or cfg()).structured_output, template)


@pytest.mark.parametrize("body, template, message", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, HERMES_TEMPLATE,
     "`tool_choice`: no function named 'nope' in `tools`"),
    ({"tool_choice": "required"}, HERMES_TEMPLATE, "`tool_choice`: 'required' needs `tools`"),
    ({"tools": [TOOL]}, "{{ messages }}{{ tools }}", "`tools`: the model's tool-call format is not one this server"),
])
def test_tool_errors_name_the_field(body, template, message):
    with pytest.raises(ValidationError) as e:
        _chat_tools(body, template)
    assert message in str(e.value)


def test_tool_choice_decides_rendering_and_grammar():
    assert _chat_tools({"tools": [TOOL], "tool_choice": "none"}).tools is None
    auto = _chat_tools({"tools": [TOOL]})
    assert auto.tools[0]["function"]["name"] == "get_weather" and auto.grammar is None and auto.fmt == "hermes"
    required = _chat_tools({"tools": [TOOL], "tool_choice": "required"})
    assert required.grammar.kind == "structural_tag" and required.grammar.field == "tools"
    tag = json.loads(required.grammar.value)["format"]
    assert tag["type"] == "tags_with_separator" and tag["stop_after_first"] is False
    named = _chat_tools({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.grammar.value)["format"]["stop_after_first"] is True
    single = _chat_tools({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(single.grammar.value)["format"]["stop_after_first"] is True
    # --tool-call-parser names the format a template does not show
    assert _chat_tools({"tools": [TOOL]}, "{{ tools }}", cfg(TOOL_CALL_PARSER="mistral")).fmt == "mistral"
    with pytest.raises(ValidationError, match="grammar is not supported"):
        _chat_tools({"tools": [TOOL], "tool_choice": "required"}, config=cfg(DISABLE_GRAMMAR_SUPPORT="true"))


def _prompt(body: dict, template: str) -> str:
    """The prompt the model gets for a chat request, rendered by a real tokenizer with `template`."""
    from gaudi_runtime.router.openai_validation import chat_prompt, chat_tools
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request
    from gaudi_runtime.router.tokenizer import RouterTokenizer
    from gaudi_runtime.tools.tiny_model import train_tokenizer

    req = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "weather?"}], **body})
    tokenizer = RouterTokenizer(train_tokenizer(chat_template=template))
    return chat_prompt(req, tokenizer, chat_tools(req, cfg().structured_output, template), images_allowed=False)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["auto", "required", NAMED])
def test_a_template_without_tools_gets_them_appended_to_the_last_message(choice):
    from gaudi_runtime.router.tool_calls import default_tool_prompt
    from gaudi_runtime.tools.tiny_model import CHAT_TEMPLATE

    prompt = _prompt({"tools": [TOOL], "tool_choice": choice}, CHAT_TEMPLATE)
    shown = "weather?\n---\n" + json.dumps([TOOL]) + "\n" + default_tool_prompt("llama3_json")
    assert prompt == f"<s>user: {shown}\nassistant:"
    assert '{"name": <function name>, "parameters": <arguments object>}' in prompt  # the format the parser reads
    # the client's own instruction (TGI's `tool_prompt`) replaces the default one; an empty one does not
    mine = _prompt({"tools": [TOOL], "tool_choice": choice, "tool_prompt": "Call get_weather."}, CHAT_TEMPLATE)
    assert mine == "<s>user: weather?\n---\n" + json.dumps([TOOL]) + "\nCall get_weather.\nassistant:"
    assert _prompt({"tools": [TOOL], "tool_choice": choice, "tool_prompt": ""}, CHAT_TEMPLATE) == prompt
    # `none`: no tools, no prompt
    assert _prompt({"tools": [TOOL], "tool_choice": "none"}, CHAT_TEMPLATE) == "<s>user: weather?\nassistant:"


def test_a_template_without_tools_is_answered_in_llama3_json_unless_configured():
    from gaudi_runtime.tools.tiny_model import CHAT_TEMPLATE

    required = _chat_tools({"tools": [TOOL], "tool_choice": "required"}, CHAT_TEMPLATE)
    assert (required.fmt, required.tools) == ("llama3_json", None) and "get_weather" in required.prompt
    tag = json.loads(required.grammar.value)["format"]
    assert tag["tags"][0]["begin"] == '{"name": "get_weather", "parameters": '
    hermes = _chat_tools({"tools": [TOOL]}, CHAT_TEMPLATE, cfg(TOOL_CALL_PARSER="hermes"))
    assert hermes.fmt == "hermes" and "<tool_call>" in hermes.prompt


def test_a_template_that_renders_tools_gets_only_a_tool_prompt_the_client_sent():
    from gaudi_runtime.tools.tiny_model import CHAT_TEMPLATES

    template = CHAT_TEMPLATES["qwen2"]
    plain = _prompt({"tools": [TOOL]}, template)
    assert plain.count('"get_weather"') == 1 and "---" not in plain  # the template's own rendering, once
    told = _prompt({"tools": [TOOL], "tool_prompt": "Use the tools."}, template)
    assert told == plain.replace("weather?", "weather?\n---\nUse the tools.")


def test_history_tool_calls_reach_the_template_with_object_arguments():
    from gaudi_runtime.router.openai_validation import chat_messages
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    req = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    msgs = chat_messages(req.messages)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["content"] == "" and msgs[2]["tool_call_id"] == "c1"


# --- JSON schemas in requests: size and depth ----------------------------------------------------

def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_json_depth_is_measured_without_recursion():
    from gaudi_runtime.router.schema_limits import json_depth

    assert [json_depth(v, 10) for v in (3, "x", {}, [], {"a": [1]}, [[[]]])] == [0, 0, 1, 1, 2, 3]
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_depth(deep, 32) == 33  # counting stops once past the limit


def test_json_schema_limits_name_the_setting():
    from gaudi_runtime.router.schema_limits import check_json_schema

    check_json_schema(_nested(4), "grammar", 1000, 8)
    check_json_schema("[a-z]+", "grammar", 1000, 8)  # a regular expression: only its size counts
    with pytest.raises(ValidationError, match=r"`grammar` is nested more than 8 levels deep \(--max-json-schema-depth\)"):
        check_json_schema(_nested(5), "grammar", 1000, 8)  # each level is an object and its `properties`
    with pytest.raises(ValidationError, match=r"more than 8 levels deep"):
        check_json_schema("[" * 5000 + "]" * 5000, "grammar", 100_000, 8)  # JSON text is parsed first
    with pytest.raises(ValidationError, match=r"more than 8 levels deep"):
        check_json_schema("[" * 100_000 + "]" * 100_000, "grammar", 10**6, 8)  # past the parser's recursion
    with pytest.raises(ValidationError, match=r"`tools\[0\].function.parameters` is 1\d\d bytes, "
                                              r"more than --max-json-schema-bytes \(100\)"):
        check_json_schema({"enum": ["x" * 30] * 4}, "tools[0].function.parameters", 100, 8)


def test_grammar_limits_apply_before_anything_reads_it():
    big = {"type": "json", "value": {"enum": ["x" * 100] * 400}}
    assert "more than --max-json-schema-bytes (32768)" in bad({"grammar": big})
    assert "more than 32 levels deep" in bad({"grammar": {"type": "json", "value": _nested(20)}})
    assert "more than 2 levels deep" in bad({"grammar": {"type": "json", "value": _nested(2)}},
                                            config=cfg(MAX_JSON_SCHEMA_DEPTH="2"))


def test_chat_schemas_are_bounded():
    from gaudi_runtime.router.openai_validation import check_chat_schemas
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    def chat(**fields):
        return parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **fields})

    small = cfg(MAX_JSON_SCHEMA_BYTES="200", MAX_JSON_SCHEMA_DEPTH="4").structured_output
    check_chat_schemas(chat(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                     "schema": {"type": "object"}}},
                            tools=[{"function": {"name": "f", "parameters": {"type": "object"}}}]), small)
    with pytest.raises(ValidationError, match=r"`response_format.json_schema.schema` is nested more than 4"):
        check_chat_schemas(chat(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                        "schema": _nested(3)}}),
                           small)
    with pytest.raises(ValidationError, match=r"`guided_json` is nested more than 4"):
        check_chat_schemas(chat(guided_json=_nested(5)), small)
    with pytest.raises(ValidationError, match=r"`tools\[1\].function.parameters` is \d+ bytes"):
        check_chat_schemas(chat(tools=[{"function": {"name": "f"}},
                                       {"function": {"name": "g", "parameters": {"enum": ["y" * 300]}}}]), small)


def test_a_body_nested_past_the_parsers_limit_is_a_422():
    with pytest.raises(ValidationError, match="nested too deeply"):
        parse_json_body(b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@pytest.mark.parametrize("env, message", [
    ({"MAX_REQUEST_BYTES": "0"}, "--max-request-bytes must be positive"),
    ({"MAX_JSON_SCHEMA_DEPTH": "0"}, "--max-json-schema-depth must be positive"),
    ({"MAX_IMAGES_PER_REQUEST": "-1"}, "--max-images-per-request must be >= 0"),
    ({"MAX_STOP_SEQUENCES": "-1"}, "--max-stop-sequences must be >= 0"),
    ({"MAX_BEST_OF": "0"}, "--max-best-of must be positive"),
])
def test_limits_are_checked_at_start(env, message):
    from gaudi_runtime.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(None, {"MODEL_ID": "m", **env})


def test_top_k_fits_tgis_type():
    assert "`top_k`: expected a 32-bit unsigned integer, got 4294967296" in bad({"top_k": 2**32})
    assert ok({"top_k": 2**32 - 1}).request.sampling.top_k == 2**32 - 1


def test_a_tgi_body_and_an_openai_body_asking_the_same_become_the_same_request():
    from gaudi_runtime.router.request_models import CompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    tgi = ok({"max_new_tokens": 4, "temperature": 0.5, "do_sample": True, "top_p": 0.9, "seed": 7, "stop": ["x"],
              "details": True, "grammar": {"type": "json", "value": schema}}, inputs="a b").request
    [openai] = _openai(CompletionRequest, {"prompt": "a b", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                                           "seed": 7, "stop": "x", "guided_json": schema})
    assert openai.input_ids == tgi.input_ids and openai.stopping == tgi.stopping
    assert openai.sampling == tgi.sampling and openai.details and tgi.details
    # The schema's compact text, written once, is what the shards compile (the field names differ).
    assert openai.grammar.value == tgi.grammar.value == json.dumps(schema, separators=(",", ":"))


def test_a_schema_is_serialised_once_for_its_limits_and_its_grammar():
    from gaudi_runtime.router.schema_limits import measure
    from gaudi_runtime.router.validation import json_schema_spec

    measured = measure({"type": "string"}, "guided_json", cfg().structured_output)
    assert json_schema_spec(measured, "guided_json").value is measured.text
