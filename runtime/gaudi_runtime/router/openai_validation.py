"""OpenAI's completion and chat requests -> validated requests for the engine.

The fields TGI also has become TGI `parameters` and pass TGI's checks and limits (`validation`), so
both APIs refuse the same things in the same words. As in TGI, temperature 0 means greedy decoding
and any other temperature (or none) samples. `frequency_penalty` and `presence_penalty` keep OpenAI's
meaning, counted over the generated tokens only; TGI's own `frequency_penalty` (over the prompt too,
divided by the length) is a different knob and stays off here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from gaudi_runtime.config import LimitsConfig, StructuredOutputConfig
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    GenerateParameters,
    OpenAIRequest,
    parse_request,
)
from gaudi_runtime.router.schema_limits import check_json_schemas
from gaudi_runtime.router.tokenizer import RouterTokenizer, TokenizerError
from gaudi_runtime.router.tool_calls import call_grammar, renders_tools, tool_prompt, tools_format
from gaudi_runtime.router.types import GrammarSpec, ValidRequest
from gaudi_runtime.router.validation import (
    json_schema_spec,
    per_choice_requests,
    tokenize_input,
    validate_parameters,
    validate_with_images,
)


def generate_parameters(req: OpenAIRequest, max_tokens: int | None, limits: LimitsConfig,
                        **extra) -> GenerateParameters:
    """The TGI parameters of an OpenAI request; `extra` holds the route's own (echo, logprobs)."""
    if req.n > limits.max_n:
        raise ValidationError(f"`n` must be <= {limits.max_n} (--max-n). Given: {req.n}")
    params = {"details": True, "max_new_tokens": max_tokens, "top_p": req.top_p, "seed": req.seed,
              "repetition_penalty": req.repetition_penalty, "stop": req.stop, "ignore_eos": req.ignore_eos,
              **extra}
    if req.temperature == 0.0:
        params["do_sample"] = False
    else:
        params.update(do_sample=True, temperature=req.temperature)
    return parse_request(GenerateParameters, params)


def with_openai_penalties(request: ValidRequest, req: OpenAIRequest) -> ValidRequest:
    sampling = replace(request.sampling, generated_frequency_penalty=req.frequency_penalty,
                       presence_penalty=req.presence_penalty)
    return replace(request, sampling=sampling)


# --- constrained output ---------------------------------------------------------------------------

def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/-\"" else c for c in text)


def output_grammar(req: OpenAIRequest, structured: StructuredOutputConfig) -> GrammarSpec | None:
    """The constraint `response_format` or vLLM's `guided_json` / `guided_regex` / `guided_choice` asks for."""
    given = [f for f in ("guided_json", "guided_regex", "guided_choice") if getattr(req, f) is not None]
    if req.response_format is not None and req.response_format.type != "text":
        given.insert(0, "response_format")
    if not given:
        return None
    if len(given) > 1:
        raise ValidationError(f"`{given[1]}`: give only one of {', '.join(given)}")
    if structured.disable_grammar_support:
        raise ValidationError(f"`{given[0]}`: grammar is not supported (--disable-grammar-support)")
    if req.guided_json is not None:
        return json_schema_spec(req.guided_json, "guided_json")
    if req.guided_regex is not None:
        return GrammarSpec("regex", req.guided_regex, "guided_regex")
    if req.guided_choice is not None:
        return GrammarSpec("regex", "(" + "|".join(_regex_literal(c) for c in req.guided_choice) + ")",
                           "guided_choice")
    fmt = req.response_format
    if fmt.type == "json_object":
        return json_schema_spec({"type": "object"}, "response_format")
    if fmt.json_schema is None:
        raise ValidationError("`response_format.json_schema` is required when `response_format.type` is json_schema")
    return json_schema_spec(fmt.json_schema.schema_, "response_format.json_schema.schema", "response_format")


# --- /v1/completions ------------------------------------------------------------------------------

def completion_requests(req: CompletionRequest, limits: LimitsConfig, structured: StructuredOutputConfig,
                        tokenizer: RouterTokenizer) -> list[ValidRequest]:
    """One validated request per prompt and choice."""
    check_json_schemas(output_schemas(req), structured)
    sequences = completion_sequences(req, limits)
    extra: dict = {"return_full_text": req.echo}
    if req.logprobs:
        _check_top(req.logprobs, "logprobs", limits)
        extra["top_n_tokens"] = req.logprobs
    params = generate_parameters(req, req.max_tokens, limits, **extra)
    grammar = output_grammar(req, structured)
    out = []
    for text, ids in prompts(req.prompt, limits, tokenizer):
        job = validate_parameters(text, ids, params, limits, structured, stream=req.stream, grammar=grammar)
        request = job.request
        out += per_choice_requests(with_openai_penalties(request, req), sequences, req.seed is not None)
    return out


def completion_sequences(req: CompletionRequest, limits: LimitsConfig) -> int:
    """Sequences to generate per prompt: `best_of` (the n best are returned), else `n`."""
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if req.best_of < req.n:
        raise ValidationError(f"`best_of` must be >= `n`. Given: best_of {req.best_of}, n {req.n}")
    if req.best_of > limits.max_best_of:
        raise ValidationError(f"`best_of` must be <= {limits.max_best_of} (--max-best-of). Given: {req.best_of}")
    if req.stream:
        raise ValidationError("`best_of` != `n` is not supported when streaming")
    return req.best_of


def _check_top(n: int, name: str, limits: LimitsConfig) -> None:
    """Top tokens per step, within --max-top-n-tokens; the error names the OpenAI field."""
    if n > limits.max_top_n_tokens:
        raise ValidationError(f"`{name}` must be <= {limits.max_top_n_tokens} (--max-top-n-tokens). Given: {n}")


def prompts(prompt: str | list[str] | list[int], limits: LimitsConfig,
            tokenizer: RouterTokenizer) -> list[tuple[str, list[int]]]:
    """`prompt` as (text, token ids) pairs: a string, a list of strings, or one prompt's token ids."""
    if isinstance(prompt, str):
        return [(prompt, tokenize_input(prompt, tokenizer))]
    if isinstance(prompt[0], int):
        try:
            tokenizer.check_ids(prompt)
        except TokenizerError as e:
            raise ValidationError(f"`prompt`: {e}") from None
        return [(tokenizer.decode(prompt), list(prompt))]
    if len(prompt) > limits.max_client_batch_size:
        raise ValidationError(
            f"Number of prompts ({len(prompt)}) exceeds the maximum client batch size "
            f"({limits.max_client_batch_size})")
    return [(p, tokenize_input(p, tokenizer)) for p in prompt]


# --- /v1/chat/completions -------------------------------------------------------------------------

def output_schemas(req: OpenAIRequest) -> list[tuple[str, object]]:
    """The schemas and patterns a request's output constraint carries, by field."""
    fmt = req.response_format.json_schema if req.response_format is not None else None
    return [("response_format.json_schema.schema", None if fmt is None else fmt.schema_),
            ("guided_json", req.guided_json), ("guided_regex", req.guided_regex)]


def check_chat_schemas(req: ChatCompletionRequest, structured: StructuredOutputConfig) -> None:
    """The JSON schemas a chat request carries (`response_format`, vLLM's guided fields, each tool's
    parameters), bounded before the template renders or a grammar compiles them."""
    fields = output_schemas(req)
    fields += [(f"tools[{i}].function.parameters", t.function.parameters) for i, t in enumerate(req.tools or [])]
    check_json_schemas(fields, structured)


def chat_parameters(req: ChatCompletionRequest, limits: LimitsConfig) -> GenerateParameters:
    extra = {}
    if req.logprobs and req.top_logprobs:
        _check_top(req.top_logprobs, "top_logprobs", limits)
        extra["top_n_tokens"] = req.top_logprobs
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    return generate_parameters(req, max_tokens, limits, **extra)


@dataclass
class ChatTools:
    """What a chat request's tools make of it: the tools for the template (None: it does not render
    them), the text appended to the last message (the tools and how to call them, when the template
    does not render them: `tool_calls.tool_prompt`), the grammar that forces a call (tool_choice
    required or named), and the format to parse calls from (None: no tools)."""

    tools: list[dict] | None = None
    grammar: GrammarSpec | None = None
    fmt: str | None = None
    prompt: str | None = None


def chat_tools(req: ChatCompletionRequest, structured: StructuredOutputConfig,
               chat_template: str | None) -> ChatTools:
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    if not req.tools:
        if choice != "none" and choice != "auto":
            raise ValidationError(f"`tool_choice`: {named or choice!r} needs `tools`")
        return ChatTools()
    names = [t.function.name for t in req.tools]
    if named is not None and named not in names:
        raise ValidationError(f"`tool_choice`: no function named {named!r} in `tools`")
    if choice == "none":
        return ChatTools()
    fmt = tools_format(chat_template, structured.tool_call_parser)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    rendered = renders_tools(chat_template)
    shown = ChatTools(tools if rendered else None, None, fmt, tool_prompt(tools, fmt, req.tool_prompt, rendered))
    if choice == "auto":
        return shown
    if structured.disable_grammar_support:
        raise ValidationError("`tool_choice`: grammar is not supported (--disable-grammar-support); use auto")
    chosen = [(t.function.name, t.function.parameters) for t in req.tools if named in (None, t.function.name)]
    return replace(shown, grammar=call_grammar(fmt, chosen, several=named is None and req.parallel_tool_calls))


def chat_prompt(req: ChatCompletionRequest, tokenizer: RouterTokenizer, tools: ChatTools, *,
                images_allowed: bool) -> str:
    """The conversation (and the tools, when the model may call them) rendered by the model's chat
    template; the tool prompt, if any, ends the last message (as TGI appends its `tool_prompt`)."""
    messages = chat_messages(req.messages, images_allowed=images_allowed)
    if tools.prompt:
        messages[-1]["content"] += tools.prompt
    try:
        return tokenizer.apply_chat_template(messages, tools=tools.tools, variables=req.chat_template_kwargs)
    except TokenizerError as e:
        raise ValidationError(str(e)) from None


def chat_messages(messages: list[ChatMessage], *, images_allowed: bool = False) -> list[dict]:
    """Messages for the chat template: content as text, an image as TGI's markdown `![](url)`;
    every other field as the client sent it."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(_content_part(i, p, images_allowed) for p in content)
        message = {**m.model_dump(exclude_none=True), "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = [_history_call(c.model_dump(exclude_none=True)) for c in m.tool_calls]
        _both_reasoning_names(message)
        out.append(message)
    return out


def _both_reasoning_names(message: dict) -> None:
    """An earlier answer's thinking under both names: clients send back vLLM's `reasoning` (or the
    older `reasoning_content`), and templates read `reasoning_content` (Qwen3's)."""
    for have, want in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
        if message.get(have) is not None and want not in message:
            message[want] = message[have]


def _history_call(call: dict) -> dict:
    """A call of the history as chat templates take it: arguments as an object (OpenAI sends JSON text)."""
    args = call["function"]["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # a template may print it as it came
    return {**call, "function": {**call["function"], "arguments": args}}


def _content_part(i: int, part: ContentPart, images_allowed: bool) -> str:
    if part.type == "text" and part.text is not None:
        return part.text
    if part.type == "image_url":
        if not images_allowed:
            raise ValidationError(f"`messages[{i}].content`: only text parts are supported: this model takes no images")
        url = part.image_url if isinstance(part.image_url, str) else getattr(part.image_url, "url", None)
        if not url:
            raise ValidationError(f"`messages[{i}].content`: an `image_url` part needs a string `url`")
        return f"![]({url})"
    raise ValidationError(f"`messages[{i}].content`: only text and image_url parts are supported")


def chat_requests(prompt: str, images, params: GenerateParameters, req: ChatCompletionRequest, limits: LimitsConfig,
                  structured: StructuredOutputConfig, tokenizer: RouterTokenizer,
                  tools: ChatTools) -> list[ValidRequest]:
    """The rendered prompt (its special tokens come from the template, none are added) validated, one
    request per choice."""
    grammar = output_grammar(req, structured)
    if tools.grammar is not None:
        if grammar is not None:
            raise ValidationError(f"`{grammar.field}` cannot be combined with `tool_choice` required or named")
        grammar = tools.grammar
    if images is not None:
        job = validate_with_images(prompt, images, params, limits, structured, tokenizer, stream=req.stream,
                                   add_special_tokens=False, grammar=grammar)
    else:
        ids = tokenize_input(prompt, tokenizer, add_special_tokens=False)
        job = validate_parameters(prompt, ids, params, limits, structured, stream=req.stream, grammar=grammar)
    return per_choice_requests(with_openai_penalties(job.request, req), req.n, req.seed is not None)
