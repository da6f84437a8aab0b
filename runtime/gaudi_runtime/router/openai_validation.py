"""OpenAI's completion and chat requests -> validated requests for the engine.

A body is parsed once into the same `GenerationOptions` a TGI body becomes, and ends in the same
`validation.validate`, so both APIs refuse the same things in the same words. As in TGI, temperature 0 means greedy decoding
and any other temperature (or none) samples. `frequency_penalty` and `presence_penalty` keep OpenAI's
meaning, counted over the generated tokens only; TGI's own `frequency_penalty` (over the prompt too,
divided by the length) is a different knob and stays off here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from gaudi_runtime.config import LimitsConfig, StructuredOutputConfig
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.reasoning import ThinkingTokens
from gaudi_runtime.router.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    OpenAIRequest,
)
from gaudi_runtime.router.schema_limits import MeasuredSchema, check_json_schemas, compact
from gaudi_runtime.router.tokenizer import RouterTokenizer, TokenizerError
from gaudi_runtime.router.tool_calls import call_grammar, renders_tools, tool_prompt, tools_format
from gaudi_runtime.router.types import GenerationOptions, GrammarSpec, ValidRequest
from gaudi_runtime.router.validation import (
    check_stop,
    json_schema_spec,
    per_choice_requests,
    tokenize_input,
    validate,
)


def check_openai(req: OpenAIRequest, max_tokens: int | None, limits: LimitsConfig) -> None:
    """The limits an OpenAI body's own fields answer to, worded as TGI's for the same knobs."""
    if req.n > limits.max_n:
        raise ValidationError(f"`n` must be <= {limits.max_n} (--max-n). Given: {req.n}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValidationError(f"`max_new_tokens` must be strictly positive. Given: {max_tokens}")


def openai_options(req: OpenAIRequest, max_tokens: int | None, limits: LimitsConfig, *, grammar: GrammarSpec | None,
                   top_n_tokens: int = 0, echo: bool = False,
                   adapter: tuple[int, int] = (0, 0)) -> GenerationOptions:
    """An OpenAI body as the typed options (after `check_openai`): temperature 0 is greedy, the
    penalties keep OpenAI's meaning (over the generated tokens)."""
    check_stop(req.stop, limits)
    sample = req.temperature != 0.0
    return GenerationOptions(
        max_new_tokens=max_tokens, do_sample=sample, temperature=req.temperature if sample else None,
        top_p=req.top_p, repetition_penalty=req.repetition_penalty, seed=req.seed, stop=tuple(req.stop),
        ignore_eos=req.ignore_eos, generated_frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, top_n_tokens=top_n_tokens, details=True, return_full_text=echo,
        grammar=grammar, stream=req.stream, adapter=adapter[0], adapter_load=adapter[1])


# --- constrained output ---------------------------------------------------------------------------

ANY_OBJECT = compact({"type": "object"})
RESPONSE_SCHEMA = "response_format.json_schema.schema"


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/-\"" else c for c in text)


def output_grammar(req: OpenAIRequest, structured: StructuredOutputConfig,
                   measured: dict[str, MeasuredSchema | None]) -> GrammarSpec | None:
    """The constraint `response_format` or vLLM's `guided_json` / `guided_regex` / `guided_choice` asks for;
    `measured`: the schemas as `measure_outputs` read them."""
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
        return json_schema_spec(measured["guided_json"], "guided_json")
    if req.guided_regex is not None:
        return GrammarSpec("regex", req.guided_regex, "guided_regex")
    if req.guided_choice is not None:
        return GrammarSpec("regex", "(" + "|".join(_regex_literal(c) for c in req.guided_choice) + ")",
                           "guided_choice")
    fmt = req.response_format
    if fmt.type == "json_object":
        return GrammarSpec("json", ANY_OBJECT, "response_format")
    if fmt.json_schema is None:
        raise ValidationError("`response_format.json_schema` is required when `response_format.type` is json_schema")
    return json_schema_spec(measured[RESPONSE_SCHEMA], RESPONSE_SCHEMA, "response_format")


# --- /v1/completions ------------------------------------------------------------------------------

def completion_requests(req: CompletionRequest, limits: LimitsConfig, structured: StructuredOutputConfig,
                        tokenizer: RouterTokenizer, *, adapter: tuple[int, int] = (0, 0),
                        thinking: ThinkingTokens | None = None) -> list[ValidRequest]:
    """One validated request per prompt and choice; `adapter`: the (slot, load) `model` names."""
    measured = measure_outputs(req, structured)
    sequences = completion_sequences(req, limits)
    if req.logprobs:
        _check_top(req.logprobs, "logprobs", limits)
    check_openai(req, req.max_tokens, limits)
    grammar = output_grammar(req, structured, measured)
    options = openai_options(req, req.max_tokens, limits, grammar=grammar, top_n_tokens=req.logprobs or 0,
                             echo=req.echo, adapter=adapter)
    out = []
    for text, ids in prompts(req.prompt, limits, tokenizer):
        request = validate(text, ids, options, limits, thinking=thinking)
        out += per_choice_requests(request, sequences, req.seed is not None)
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
    return [(RESPONSE_SCHEMA, None if fmt is None else fmt.schema_),
            ("guided_json", req.guided_json), ("guided_regex", req.guided_regex)]


def measure_outputs(req: OpenAIRequest, structured: StructuredOutputConfig) -> dict[str, MeasuredSchema | None]:
    """The output constraint's schemas bounded, by field, before anything reads them."""
    fields = output_schemas(req)
    return dict(zip([name for name, _ in fields], check_json_schemas(fields, structured), strict=True))


def check_chat_schemas(req: ChatCompletionRequest, structured: StructuredOutputConfig) -> dict[str, MeasuredSchema | None]:
    """The JSON schemas a chat request carries (`response_format`, vLLM's guided fields, each tool's
    parameters), bounded before the template renders or a grammar compiles them; the output's, measured."""
    measured = measure_outputs(req, structured)
    tools = [(f"tools[{i}].function.parameters", t.function.parameters) for i, t in enumerate(req.tools or [])]
    check_json_schemas(tools, structured)
    return measured


def chat_limits(req: ChatCompletionRequest, limits: LimitsConfig) -> tuple[int | None, int]:
    """A chat body's token budget and top log-probabilities per step, checked."""
    top = 0
    if req.logprobs and req.top_logprobs:
        _check_top(req.top_logprobs, "top_logprobs", limits)
        top = req.top_logprobs
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    check_openai(req, max_tokens, limits)
    return max_tokens, top


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


@dataclass(frozen=True)
class ChatBody:
    """A chat request parsed and checked, before its prompt is tokenized: the body, its output
    schemas as measured, its token budget and top log-probabilities, its tools, its adapter."""

    req: ChatCompletionRequest
    measured: dict[str, MeasuredSchema | None]
    max_tokens: int | None
    top_n_tokens: int
    tools: ChatTools
    adapter: tuple[int, int] = (0, 0)


def chat_requests(prompt: str, images, body: ChatBody, limits: LimitsConfig, structured: StructuredOutputConfig,
                  tokenizer: RouterTokenizer, thinking: ThinkingTokens | None = None) -> list[ValidRequest]:
    """The rendered prompt (its special tokens come from the template, none are added) validated, one
    request per choice."""
    req, tools = body.req, body.tools
    grammar = output_grammar(req, structured, body.measured)
    if tools.grammar is not None:
        if grammar is not None:
            raise ValidationError(f"`{grammar.field}` cannot be combined with `tool_choice` required or named")
        grammar = tools.grammar
    options = openai_options(req, body.max_tokens, limits, grammar=grammar, top_n_tokens=body.top_n_tokens,
                             adapter=body.adapter)
    ids = tokenize_input(prompt if images is None else images.text, tokenizer, add_special_tokens=False)
    request = validate(prompt, ids, options, limits, images=images, thinking=thinking)
    return per_choice_requests(request, req.n, req.seed is not None)
