"""The response bodies of both APIs as pydantic models: what the OpenAPI document says each route
answers (`openapi`), and the contract the tests hold every answer of the real server to.

The handlers build these shapes as dictionaries and, for the per-token stream events, as JSON text
from templates (`tgi_api`, `openai_api`, `json_text`): a pydantic object per token would cost the
streams' throughput. So the models are the checked contract rather than the builders: the tests
validate every kind of answer against the document generated from them (tests/runtime/test_openapi.py,
and the fuzz test, tests/runtime/test_fuzz_api.py, which does so for whatever bodies it sends).

They follow TGI's and OpenAI's names and say exactly what the server sends: a field it always sends
is required (null where it may be null); one it sends only when asked (`details`, `top_tokens`,
`tool_calls`, ...) is optional and never null; no other field is sent (`extra="forbid"`: the document
says `additionalProperties: false`). Only the probes and /info, whose engine fields vary with the
engine and grow with it, list their fields but allow others.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

FinishReason = Literal["length", "eos_token", "stop_sequence"]
OpenAIFinishReason = Literal["length", "stop"]
ChatFinishReason = Literal["length", "stop", "tool_calls"]
ErrorType = Literal["validation", "generation", "overloaded", "unhealthy", "authentication",
                    "incomplete_generation", "internal"]


class Closed(BaseModel):
    """A body with exactly these fields."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """A body with these fields and possibly others."""

    model_config = ConfigDict(extra="allow")


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def absent(description: str | None = None) -> Any:
    """A field the server leaves out, rather than sending null, when it does not apply."""
    return Field(None, description=description, json_schema_extra=_no_default)


# --- errors and probes ---------------------------------------------------------------------------

class WarmupProgress(Open):
    done: int
    total: int
    phase: str
    from_cache: bool | None = Field(None, description="Whether this warmup loads its graphs from the recipe cache "
                                                      "(null without one)")


class StartupSeconds(Open):
    download: float | None = Field(None, description="Getting the model (null for a local directory)")
    load: float | None = Field(None, description="Loading and sharding the weights")
    warmup: float | None = Field(None, description="Warming up (null until done)")


class ErrorResponse(Closed):
    """TGI's error body, for every status from 401 to 503 (and an error event ending a stream)."""

    error: str
    error_type: ErrorType = Field(description="validation (422, 413), generation (424), overloaded (429), "
                                              "unhealthy (503), authentication (401); in an event ending a "
                                              "stream, incomplete_generation for a failure of the server's own")
    warmup: WarmupProgress = absent("While the server warms up (503)")


class HealthResponse(Open):
    status: str = Field(description="ok, loading, warming_up, failed or draining")
    warmup: WarmupProgress | None = None
    error: str | None = Field(None, description="Why the server failed, or that it is shutting down")
    error_type: str | None = Field(None, description="unhealthy, while draining")
    startup_seconds: StartupSeconds | None = Field(None, description="Once ready: where the start went")
    warmup_from_cache: bool | None = Field(None, description="Once ready: whether warmup came from the recipe "
                                                             "cache (null without one)")


class PingResponse(Closed):
    status: Literal["ok"]


class Info(Open):
    """TGI's /info, with this server's engine fields (KV cache, warmup, start-up)."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None = None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int | None = Field(None, description="max_input_tokens, under TGI's older name")
    max_total_tokens: int
    max_top_n_tokens: int
    max_client_batch_size: int
    validation_workers: int
    waiting_served_ratio: float | None = None
    max_batch_total_tokens: int | None = Field(None, description="What the KV cache holds, once the shards "
                                               "have measured it")
    max_waiting_tokens: int | None = None
    max_batch_size: int | None = None
    router: str
    version: str
    sha: str | None = None
    docker_label: str | None = None
    prefix_caching: bool | None = Field(None, description="Whether KV blocks of earlier prompts are reused "
                                        "(--prefix-caching); kv_blocks_cached, prefix_cache_queries and "
                                        "prefix_cache_hits say how much")
    attention: str | None = Field(None, description="The attention kernels the shards run (on a CPU: whether "
                                  "decode reads the paged KV cache in place)")
    state: str | None = Field(None, description="The engine's state: loading, warming_up, ready or failed")
    num_shard: int | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    kv_blocks_free: int | None = None
    kv_blocks_cached: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    speculate: int | None = Field(None, description="Most tokens a step drafts per request (n-gram "
                                  "speculation, --speculate; 0: none)")
    prefill_chunks: int | None = Field(None, description="Chunks of long prompts prefilled before their last "
                                       "one (prompts longer than max_batch_prefill_tokens)")
    prefill_chunks_in_step: int | None = Field(None, description="Chunks (their last included) computed in the "
                                               "same forward pass as a decode step of the running requests")
    unwarmed_shapes: int | None = Field(None, description="Shapes run after warmup that it had not warmed")
    lora_adapters: list[str] | None = Field(None, description="The LoRA adapters registered beside the base model "
                                            "(--lora-adapters, and those loaded while serving), selected by "
                                            "`parameters.adapter_id` or `model`")
    max_loras: int | None = Field(None, description="Device slots of the adapters' weights (--max-loras): the most "
                                  "distinct adapters in one running batch")
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = Field(None, description="Adapters whose weights the shards keep in host memory "
                                      "(--max-cpu-loras, least recently used dropped); registered adapters may "
                                      "be more")
    runtime_lora_updating: bool | None = Field(None, description="/v1/load_lora_adapter and "
                                               "/v1/unload_lora_adapter are served")


# --- TGI -------------------------------------------------------------------------------------------

class Token(Closed):
    id: int
    text: str
    logprob: float | None = Field(description="null where it is not finite")
    special: bool


class PrefillToken(Closed):
    id: int
    text: str
    logprob: float | None = Field(description="null for the first token, and where it is not finite")


class BestOfSequence(Closed):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = Field(description="null for greedy decoding")
    prefill: list[PrefillToken] = Field(description="With decoder_input_details; empty without")
    tokens: list[Token]
    top_tokens: list[list[Token]] = absent("With top_n_tokens")


class Details(Closed):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = Field(description="null for greedy decoding")
    prefill: list[PrefillToken] = Field(description="With decoder_input_details; empty without")
    tokens: list[Token]
    top_tokens: list[list[Token]] = absent("With top_n_tokens")
    best_of_sequences: list[BestOfSequence] = absent("With best_of > 1: the sequences not chosen")


class GenerateResponse(Closed):
    generated_text: str
    details: Details = absent("With details: true")


class CompatGenerateResponse(RootModel[list[GenerateResponse]]):
    """`/` without streaming: TGI answers a list of one."""


class StreamDetails(Closed):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(Closed):
    """One server-sent event of /generate_stream; the last carries `generated_text` and `details`."""

    index: int
    token: Token
    top_tokens: list[Token] = Field(description="With top_n_tokens; empty without")
    generated_text: str | None
    details: StreamDetails | None


class SimpleToken(Closed):
    id: int
    text: str
    start: int
    stop: int


class TokenizeResponse(RootModel[list[SimpleToken]]):
    """/tokenize: each token with its character offsets in the input."""


# --- OpenAI ----------------------------------------------------------------------------------------

class Usage(Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OpenAIEnvelope(Closed):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class CompletionLogprobs(Closed):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class CompletionChoice(Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="With logprobs")
    finish_reason: OpenAIFinishReason


class Completion(OpenAIEnvelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice] = Field(description="n per prompt, prompt after prompt")
    usage: Usage


class CompletionChunkChoice(Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="With logprobs")
    finish_reason: OpenAIFinishReason | None = Field(description="In the choice's last chunk")


class CompletionChunk(OpenAIEnvelope):
    """One event of a completions stream: a token of one choice, or (with `stream_options.include_usage`)
    the usage of the whole request, with no choice, after the last token."""

    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(description="In the usage chunk only")


class TopLogprob(Closed):
    token: str
    logprob: float | None = Field(description="null where it is not finite")
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="top_logprobs of them; empty without")


class ChatLogprobs(Closed):
    content: list[ChatLogprob]


class CalledFunction(Closed):
    name: str
    arguments: str = Field(description="The arguments as JSON text")


class MessageToolCall(Closed):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Closed):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls and nothing else, or when the "
                                "thinking took the whole output")
    reasoning: str | None = absent("With --reasoning-parser: the model's thinking (null when it did not think)")
    tool_calls: list[MessageToolCall] = absent("The calls the model made, when it made some")


class ChatChoice(Closed):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(description="With logprobs")
    finish_reason: ChatFinishReason = Field(description="tool_calls when the model ended after calling tools")


class ChatCompletion(OpenAIEnvelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(Closed):
    name: str = absent("In the call's first delta")
    arguments: str = Field(description="The next piece of the arguments' JSON text")


class ToolCallDelta(Closed):
    index: int = Field(description="Which call of the message this piece belongs to")
    id: str = absent("In the call's first delta")
    type: Literal["function"] = absent("In the call's first delta")
    function: FunctionCallDelta


class ChatDelta(Closed):
    """What one chunk adds to a choice's message; empty in the chunk that only ends a choice with tools."""

    role: Literal["assistant"] = absent()
    content: str = absent()
    reasoning: str = absent("With --reasoning-parser: the next piece of the thinking")
    tool_calls: list[ToolCallDelta] = absent()


class ChatChunkChoice(Closed):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(description="With logprobs")
    finish_reason: ChatFinishReason | None = Field(description="In the choice's last chunk")


class ChatCompletionChunk(OpenAIEnvelope):
    """One event of a chat stream: a piece of one choice, or (with `stream_options.include_usage`) the
    usage of the whole request, with no choice, after the last piece."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(description="In the usage chunk only")


class ModelCard(Closed):
    id: str = Field(description="The name a request's `model` selects it by")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The base model's id, or the adapter's hub id or path")
    parent: str | None = Field(description="For a LoRA adapter, the base model it applies to; null for the base")


class OpenAIErrorDetail(Closed):
    message: str
    type: str = Field(description="vLLM's kind of error: BadRequestError (400), AuthenticationError (401), "
                                  "NotFoundError (404), RateLimitError (429), ServiceUnavailableError (503), "
                                  "InternalServerError (500)")
    param: str | None = Field(description="The field at fault, when one is")
    code: str | None = Field(description="OpenAI's code, when one applies: context_length_exceeded, "
                                         "model_not_found, invalid_api_key")


class OpenAIError(Closed):
    """OpenAI's error body, as vLLM sends it: every error of a /v1 route (and the event that ends a
    /v1 stream which failed part-way), and the 404 of a `model` that names no served model or
    adapter on any route."""

    error: OpenAIErrorDetail


class ModelList(Closed):
    object: Literal["list"]
    data: list[ModelCard]
