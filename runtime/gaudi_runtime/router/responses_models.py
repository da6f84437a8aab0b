"""The Responses API's bodies as pydantic models (`POST /v1/responses`, `GET`/`DELETE
/v1/responses/{id}`): the request as it is parsed, and the response, its output items and its stream
events as the OpenAPI document describes them (the builders in `responses_convert` and
`responses_stream` make dictionaries; tests/runtime hold them to these models, as for chat).

What vLLM serves of OpenAI's Responses API: `input` as text or items (messages, function calls and
their outputs, reasoning), `instructions`, function tools and `tool_choice`, `text.format` (text,
json_object, json_schema), `max_output_tokens`, `stream`, `store` and `previous_response_id`.
Other fields OpenAI defines are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge, MinLen
from pydantic import Field

from gaudi_runtime.router.request_models import (
    Bool,
    Float,
    PositiveInt,
    RequestBody,
    Str,
    TopP,
    _must_be,
)
from gaudi_runtime.router.response_models import Closed, Open

# --- the request -----------------------------------------------------------------------------------


class InputContent(RequestBody):
    """A part of an input message: input_text / output_text (`text`), input_image (`image_url`)."""

    type: Str
    text: Str | None = None
    image_url: Str | None = None


class InputItem(RequestBody):
    """One item of `input`: a message (`role`, `content`), a `function_call` (`call_id`, `name`,
    `arguments`), a `function_call_output` (`call_id`, `output`), or a `reasoning` item (skipped)."""

    type: Str = Field("message", description="message (the default), function_call, function_call_output "
                                              "or reasoning")
    role: Str | None = None
    content: Annotated[Str | list[InputContent], _must_be("a string or a list of content parts")] | None = None
    call_id: Str | None = None
    name: Str | None = None
    arguments: Str | None = None
    output: Annotated[Str | list[InputContent], _must_be("a string or a list of content parts")] | None = None


class FunctionTool(RequestBody):
    type: Str = Field(description="Only function tools are served")
    name: Str | None = None
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = Field(None, description="Accepted; a forced call always follows the parameters")


class NamedFunction(RequestBody):
    type: Literal["function"]
    name: Str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Str | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None


ResponsesToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedFunction,
    _must_be("`none`, `auto`, `required` or {\"type\": \"function\", \"name\": ...}"),
]


class ResponsesRequest(RequestBody):
    """The body of POST /v1/responses."""

    model: Str | None = None
    input: Annotated[Str | Annotated[list[InputItem], MinLen(1)], _must_be("a string or a list of items")]
    instructions: Str | None = Field(None, description="A system message before the input (not carried over "
                                                       "by previous_response_id)")
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[Float, Ge(0.0)] | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    stream: Bool = False
    store: Bool = Field(True, description="Keep the response (in memory, the most recent ones) for GET and "
                                          "previous_response_id")
    previous_response_id: Str | None = None
    metadata: dict[str, Str] | None = None
    user: Str | None = None


# --- the response ----------------------------------------------------------------------------------

class OutputText(Closed):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(Closed):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Closed):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(Closed):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="The call's arguments as JSON text")
    status: ItemStatus


class ReasoningItem(Closed):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[MessageItem | FunctionCallItem | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(Closed):
    cached_tokens: int


class OutputTokensDetails(Closed):
    reasoning_tokens: int


class ResponseUsage(Closed):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Closed):
    reason: Literal["max_output_tokens"]


class Response(Open):
    """A response: its output items in order, and the request's settings repeated as OpenAI does."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[Any]
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool


class ResponseDeleted(Closed):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


# --- the stream's events ---------------------------------------------------------------------------

class _Event(Closed):
    sequence_number: int


class ResponseEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done",
                  "response.reasoning_part.added", "response.reasoning_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


STREAM_EVENTS = (ResponseEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                 ReasoningDeltaEvent, ReasoningDoneEvent, ArgumentsDeltaEvent, ArgumentsDoneEvent)
