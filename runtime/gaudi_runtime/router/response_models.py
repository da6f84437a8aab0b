"""The response bodies of both APIs as pydantic models: what the OpenAPI document says each route
answers (`openapi`), and what the fuzz test holds the real server's answers to.

The handlers build these shapes as dictionaries (`tgi_api`, `openai_api`); the models describe
them, following TGI's and OpenAI's names. A field the server always sends is required; one it sends
only when asked (`details`, `top_tokens`, ...) is optional. Extra fields are allowed, as in the
APIs they copy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, RootModel

FinishReason = Literal["length", "eos_token", "stop_sequence"]
OpenAIFinishReason = Literal["length", "stop"]


# --- errors and probes ---------------------------------------------------------------------------

class WarmupProgress(BaseModel):
    done: int
    total: int
    phase: str
    from_cache: bool | None = Field(None, description="Whether this warmup loads its graphs from the recipe cache "
                                                      "(null without one)")


class StartupSeconds(BaseModel):
    download: float | None = Field(None, description="Getting the model (null for a local directory)")
    load: float | None = Field(None, description="Loading and sharding the weights")
    warmup: float | None = Field(None, description="Warming up (null until done)")


class ErrorResponse(BaseModel):
    """TGI's error body, for every status from 401 to 503 (and an error event ending a stream)."""

    error: str
    error_type: str = Field(description="validation (422, 413), generation (424), overloaded (429), "
                                        "unhealthy (503), authentication (401)")
    warmup: WarmupProgress | None = Field(None, description="While the server warms up (503)")


class HealthResponse(BaseModel):
    status: str = Field(description="ok, loading, warming_up or failed")
    warmup: WarmupProgress | None = None
    error: str | None = Field(None, description="Why the server failed")
    startup_seconds: StartupSeconds | None = Field(None, description="Once ready: where the start went")
    warmup_from_cache: bool | None = Field(None, description="Once ready: whether warmup came from the recipe "
                                                             "cache (null without one)")


class PingResponse(BaseModel):
    status: Literal["ok"]


class Info(BaseModel):
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
    max_total_tokens: int
    max_top_n_tokens: int
    max_client_batch_size: int
    validation_workers: int
    router: str
    version: str
    sha: str | None = None
    docker_label: str | None = None
    prefix_caching: bool | None = Field(None, description="Whether KV blocks of earlier prompts are reused "
                                        "(--prefix-caching); kv_blocks_cached, prefix_cache_queries and "
                                        "prefix_cache_hits say how much")
    attention: str | None = Field(None, description="The attention kernels the shards run (on a CPU: whether "
                                  "decode reads the paged KV cache in place)")


# --- TGI -------------------------------------------------------------------------------------------

class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = Field(description="null where it is not finite")
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = Field(None, description="With top_n_tokens")
    best_of_sequences: list[BestOfSequence] | None = Field(None, description="With best_of > 1")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = Field(None, description="With details: true")


class CompatGenerateResponse(RootModel[list[GenerateResponse]]):
    """`/` without streaming: TGI answers a list of one."""


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int


class StreamResponse(BaseModel):
    """One server-sent event of /generate_stream; the last carries `generated_text` and `details`."""

    index: int
    token: Token
    top_tokens: list[Token]
    generated_text: str | None
    details: StreamDetails | None


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class TokenizeResponse(RootModel[list[SimpleToken]]):
    """/tokenize: each token with its character offsets in the input."""


# --- OpenAI ----------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OpenAIEnvelope(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinishReason


class Completion(OpenAIEnvelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinishReason | None


class CompletionChunk(OpenAIEnvelope):
    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: OpenAIFinishReason


class ChatCompletion(OpenAIEnvelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: OpenAIFinishReason | None


class ChatCompletionChunk(OpenAIEnvelope):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
