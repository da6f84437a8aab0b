"""The request bodies of both APIs as pydantic models, and how a body that breaks them is reported.

A model says what a body may hold: which fields, their types and ranges. That is all an API
contract (an OpenAPI document) needs, so it can be generated from these classes. What depends on
the running server (the limits in `Config`, the tokenizer, whether the model takes images) is
checked afterwards, by `validation` and `openai_validation`.

Two rules follow the clients people use:
- Unknown fields are accepted and ignored: TGI's and vLLM's clients send extensions, and OpenAI
  adds fields faster than servers learn them.
- A null field is an absent one: `text-generation` sends every parameter, most of them null.

Types are strict as in TGI's serde: `"5"` is not an integer and `true` is not a number; an integral
float (`5.0`) is an integer, since JSON has a single number type.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import (
    AliasChoices,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WrapValidator,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError

from gaudi_runtime.router.errors import ValidationError

MAX_SEED = 2**64 - 1
MAX_U32 = 2**32 - 1  # TGI's type of top_k, and what the shards' protocol carries


# --- field types -------------------------------------------------------------------------------

def _integral_float_to_int(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _one_is_a_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


def _must_be(what: str) -> WrapValidator:
    """Report a failure of the field as one error saying what it accepts: pydantic would give one
    error per member of a union, none of them telling the user what to send. When the value had
    the shape of exactly one member (a list, for `str | list[...]`), what broke inside it is the
    more useful error, and is kept."""
    def check(value: Any, handler):
        try:
            return handler(value)
        except PydanticValidationError as e:
            errors = e.errors(include_url=False)
            deep = [x for x in errors if len(x["loc"]) > 1 and isinstance(x["loc"][0], str)]
            if deep and len({x["loc"][0] for x in deep}) == 1:
                inner = {**deep[0], "loc": tuple(deep[0]["loc"][1:])}
                raise PydanticCustomError("inner_error", "{msg}", {"msg": inner["msg"], "inner": inner}) from None
            raise PydanticCustomError("field_value", "must be {what}", {"what": what}) from None

    return WrapValidator(check)


def _integer(*bounds: Any) -> Any:
    """An integer within `bounds`. The bounds come before the float conversion so that they stay
    in the integer's JSON schema (`exclusiveMinimum`, ...)."""
    return Annotated[(int, Strict(), *bounds, BeforeValidator(_integral_float_to_int))]


Int = _integer()
PositiveInt = _integer(Gt(0))
NonNegativeInt = _integer(Ge(0))
Seed = _integer(Ge(0), Le(MAX_SEED))
Float = Annotated[float, Strict(), AllowInfNan(False)]
PositiveFloat = Annotated[Float, Gt(0.0)]
Penalty = Annotated[Float, Ge(-2.0), Le(2.0)]
TopP = Annotated[Float, Gt(0.0), Le(1.0)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
StrList = Annotated[list[Str], BeforeValidator(_one_is_a_list, json_schema_input_type=Str | list[Str]),
                    _must_be("a string or a list of strings")]


def _null_is_absent_in_schema(schema: dict[str, Any]) -> None:
    """The JSON schema of a request model says what `_null_is_absent` accepts: null for every field
    that may be left out."""
    required = set(schema.get("required", ()))
    properties = schema.get("properties", {})
    for name, prop in list(properties.items()):
        if name in required or {"type": "null"} in prop.get("anyOf", ()):
            continue
        outer = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        properties[name] = {"anyOf": [prop, {"type": "null"}], **outer}


class RequestBody(BaseModel):
    """Base of every request model: unknown fields ignored, null fields absent."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_null_is_absent_in_schema)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# --- TGI -------------------------------------------------------------------------------------------

class Grammar(RequestBody):
    """TGI's constrained generation: the output follows a JSON schema or a regular expression."""

    type: Literal["json", "regex"]
    value: Annotated[dict[str, Any] | Bool | Str,
                     _must_be("a JSON schema (an object, or its JSON text) or a regular expression")] = Field(
        description="A JSON schema (type json: an object, or its JSON text) or a regular expression (type regex)")


class GenerateParameters(RequestBody):
    """TGI's `parameters` of /generate, /generate_stream and /."""

    best_of: Int | None = Field(None, description="Sample this many sequences, return the most likely")
    decoder_input_details: Bool = Field(False, description="Return the prompt tokens' log-probabilities")
    details: Bool = Field(False, description="Return tokens, finish reason and seed")
    do_sample: Bool = Field(False, description="Sample instead of greedy decoding")
    frequency_penalty: Penalty | None = Field(
        None, description="TGI's: minus penalty x count / length over the prompt and the generated tokens")
    grammar: Grammar | None = None
    max_new_tokens: PositiveInt | None = Field(
        None, description="Default: max_total_tokens - the prompt's length")
    repetition_penalty: PositiveFloat | None = None
    return_full_text: Bool = Field(False, description="Prepend the prompt to the generated text")
    seed: Seed | None = None
    stop: StrList = Field(default_factory=list, validation_alias=AliasChoices("stop", "stop_sequences"))
    temperature: PositiveFloat | None = None
    top_k: PositiveInt | None = Field(None, json_schema_extra={"maximum": MAX_U32})  # checked by validation
    top_n_tokens: Int | None = Field(None, description="Return this many most likely tokens at each step")
    top_p: TopP | None = None
    truncate: Int | None = Field(None, description="Keep only the prompt's last tokens")
    typical_p: Annotated[Float, Gt(0.0), Lt(1.0)] | None = None
    watermark: Bool = False
    adapter_id: Str | None = Field(None, description="The LoRA adapter to apply (a name of --lora-adapters); "
                                   "absent or the model's name: none")
    ignore_eos: Bool = Field(False, description="vLLM's extension: generate past the end-of-sequence token")


class GenerateRequest(RequestBody):
    """The body of TGI's /generate, /generate_stream and /."""

    inputs: Str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: Bool = Field(False, description="On /: stream server-sent events")


class TokenizeParameters(RequestBody):
    add_special_tokens: Bool = True


class TokenizeRequest(RequestBody):
    """The body of /tokenize."""

    inputs: Str
    add_special_tokens: Bool | None = None
    parameters: TokenizeParameters = Field(default_factory=TokenizeParameters)


# --- OpenAI ----------------------------------------------------------------------------------------

class LoadLoraAdapterRequest(RequestBody):
    """The body of vLLM's /v1/load_lora_adapter (served with --allow-runtime-lora-updating). Both names
    are required; a body without one gets vLLM's own message for it, from the updater."""

    lora_name: Str | None = Field(None, description="The name requests will select the adapter by (`model`)")
    lora_path: Str | None = Field(None, description="A directory the server can read, or a hub id")
    load_inplace: Bool = Field(False, description="Replace the weights of an adapter of that name already loaded")


class UnloadLoraAdapterRequest(RequestBody):
    """The body of vLLM's /v1/unload_lora_adapter (served with --allow-runtime-lora-updating)."""

    lora_name: Str | None = Field(None, description="The adapter to unload")


class StreamOptions(RequestBody):
    include_usage: Bool = False


class JSONSchemaFormat(RequestBody):
    """`response_format.json_schema`: the schema the output must follow."""

    name: Str
    description: Str | None = None
    schema_: Annotated[dict[str, Any] | Bool, _must_be("a JSON schema (an object)")] = Field(
        default_factory=dict, alias="schema", description="The JSON schema (default: any JSON object)")
    strict: Bool | None = Field(None, description="Accepted; the schema is always enforced")


class ResponseFormat(RequestBody):
    """`{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


GuidedJSON = Annotated[dict[str, Any] | Str, _must_be("a JSON schema (an object, or its JSON text)")]


class OpenAIRequest(RequestBody):
    """The fields OpenAI's completion and chat requests share (and vLLM's extensions of both)."""

    model: Str | None = None
    frequency_penalty: Penalty = Field(0.0, description="Minus penalty x times the token was generated")
    presence_penalty: Penalty = Field(0.0, description="Minus penalty once the token was generated")
    max_tokens: Int | None = Field(None, description="Default: max_total_tokens - the prompt's length")
    n: PositiveInt = Field(1, description="Choices to generate, each sampled with its own seed (at most --max-n)")
    seed: Seed | None = None
    stop: StrList = Field(default_factory=list)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[Float, Ge(0.0)] | None = Field(None, description="0 is greedy decoding")
    top_p: TopP | None = None
    user: Str | None = None
    repetition_penalty: PositiveFloat | None = Field(None, description="vLLM's extension")
    ignore_eos: Bool = Field(False, description="vLLM's extension: generate past the end-of-sequence token")
    response_format: ResponseFormat | None = None
    guided_json: GuidedJSON | None = Field(None, description="vLLM's extension: the output follows this JSON schema")
    guided_regex: Str | None = Field(None, description="vLLM's extension: the output matches this regex")
    guided_choice: Annotated[list[Str], MinLen(1)] | None = Field(
        None, description="vLLM's extension: the output is one of these strings")


Prompt = Annotated[
    Str | Annotated[list[Str], MinLen(1)] | Annotated[list[NonNegativeInt], MinLen(1)],
    _must_be("a string, a non-empty list of strings, or a list of token ids"),
]


class CompletionRequest(OpenAIRequest):
    """The body of /v1/completions."""

    prompt: Prompt
    best_of: PositiveInt | None = Field(
        None, description="Sample this many sequences, return the n with the highest mean log-probability")
    echo: Bool = Field(False, description="Prepend the prompt to the generated text")
    logprobs: NonNegativeInt | None = Field(None, description="Return this many most likely tokens")


class ImageURL(RequestBody):
    url: Str | None = None
    detail: Str | None = None


class ContentPart(RequestBody):
    """One part of a message's content: `{"type": "text", "text"}` or `{"type": "image_url", "image_url"}`."""

    type: Str
    text: Str | None = None
    image_url: Annotated[ImageURL | Str, _must_be("an object with a string `url`, or a URL")] | None = None


class FunctionCall(RequestBody):
    name: Str
    arguments: Annotated[Str | dict[str, Any], _must_be("a string of JSON, or an object")] = "{}"


class ToolCall(RequestBody):
    """A call the assistant made, as the history carries it."""

    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    """One message; fields other than these (`name`, ...) go to the chat template as they came."""

    model_config = ConfigDict(extra="allow")

    role: Str
    content: Annotated[Str | list[ContentPart], _must_be("a string or a list of text parts")] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls")
    tool_call_id: Str | None = Field(None, description="A tool message: the call it answers")


class FunctionDefinition(RequestBody):
    model_config = ConfigDict(extra="allow")

    name: Str
    description: Str | None = None
    parameters: dict[str, Any] | None = None


class Tool(RequestBody):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: Str


class NamedToolChoice(RequestBody):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _must_be("`none`, `auto`, `required` or a named function"),
]


class ChatCompletionRequest(OpenAIRequest):
    """The body of /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], MinLen(1)]
    max_completion_tokens: Int | None = Field(None, description="Preferred over max_tokens")
    logprobs: Bool = False
    top_logprobs: NonNegativeInt | None = Field(None, description="With logprobs: the most likely tokens per step")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description="Default: auto with tools, none without")
    parallel_tool_calls: Bool = Field(True, description="Whether the model may call several tools in one answer")
    tool_prompt: Str | None = Field(
        None, description="TGI's: the instruction appended, after the tools as JSON, to the last message when the "
        "chat template does not render tools (default: how to call in the server's format); with a template "
        "that renders them, appended alone when given")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: more variables for the chat template, such as {\"enable_thinking\": false} "
        "for Qwen3")


# --- parsing, with errors in TGI's wording ---------------------------------------------------------

Model = TypeVar("Model", bound=BaseModel)

_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "a boolean", "bool_parsing": "a boolean", "string_type": "a string",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "list_type": "a list",
}
_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def parse_request(model: type[Model], body: Any, *, unnamed: tuple[str, ...] = ()) -> Model:
    """`body` as a `model`, or a ValidationError (HTTP 422) naming the first field in error.

    `unnamed`: top-level fields left out of the names of the fields inside them; TGI's documentation
    and clients name its generation parameters without their `parameters` envelope."""
    try:
        return model.model_validate(body)
    except PydanticValidationError as e:
        raise ValidationError(error_message(model, e.errors(include_url=False)[0], unnamed)) from None


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_message(model: type[BaseModel], error: dict, unnamed: tuple[str, ...] = ()) -> str:
    """One pydantic error -> a message that names the field, in TGI's wording."""
    loc = tuple(error["loc"])
    shown = loc[1:] if len(loc) > 1 and loc[0] in unnamed else loc
    name, kind, given = _path(shown), error["type"], error.get("input")
    if kind == "missing":
        parent = _path(shown[:-1])
        return (f"Failed to deserialize the JSON body: missing field `{shown[-1]}`"
                + (f" in `{parent}`" if parent else ""))
    if kind in _RANGE:
        return f"`{name}` must be {_range(model, loc, error)}. Given: {_json(given)}"
    if kind == "field_value":
        return f"`{name}` {error['msg']}"
    if kind == "inner_error":
        inner = error["ctx"]["inner"]
        return error_message(model, {**inner, "loc": loc + inner["loc"]}, unnamed)
    if kind == "too_short":
        return f"`{name}` must not be empty"
    if kind == "literal_error":
        return f"Failed to deserialize the JSON body: `{name}`: expected {error['ctx']['expected']}, got {_json(given)}"
    want = _EXPECTED.get(kind)
    if want is not None:
        return f"Failed to deserialize the JSON body: `{name}`: expected {want}, got {_json(given)}"
    return f"Failed to deserialize the JSON body: `{name}`: {error['msg']}"


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, default=str)


_BOUNDS = ((Gt, "gt", ">"), (Ge, "ge", ">="), (Lt, "lt", "<"), (Le, "le", "<="))


def _range(model: type[BaseModel], loc: tuple, error: dict) -> str:
    """The field's whole allowed range, as TGI words it ("strictly positive", "> 0.0 and <= 1.0")."""
    bounds = _declared_bounds(model, loc)
    if not bounds:  # not found by walking the models: the bound that failed
        ctx = error.get("ctx", {})
        bounds = [(op, ctx[attr]) for _, attr, op in _BOUNDS if attr in ctx]
    if bounds == [(">", 0)]:
        return "strictly positive"
    return " and ".join(f"{op} {v}" for op, v in bounds)


def _declared_bounds(model: type[BaseModel], loc: tuple) -> list[tuple[str, Any]]:
    """The bounds declared on the field at `loc`, followed through nested models; a field declared
    `Annotated[X, Gt(0)] | None` holds them inside the union's member."""
    info = None
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return []
        info = fields[part]
        current = _model_in(info.annotation)
    if info is None:
        return []
    metadata = list(info.metadata)
    for arg in get_args(info.annotation):
        if get_origin(arg) is Annotated:
            metadata += arg.__metadata__
    return [(op, getattr(m, attr)) for m in metadata for cls, attr, op in _BOUNDS if isinstance(m, cls)]


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
