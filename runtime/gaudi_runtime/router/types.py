"""Plain data passed between the HTTP layer and the batching engine in the router.

The HTTP layer parses a request body into `GenerationOptions` (once, either API), then one
`ValidRequest` per prompt and choice; the engine streams
`StreamEvent`s back, in lists of those ready together. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from gaudi_runtime.params import SamplingParameters


class FinishReason(str, Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True)
class StoppingParameters:
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow: `kind` "json" (a JSON schema), "regex" or "structural_tag"
    (xgrammar's, for tool calls), `value` its text; `field` names the request field it came from, for
    the error when the shards cannot compile it."""

    kind: str
    value: str
    field: str = "grammar"
    # A reasoning model's (start token, end token, prompt opened it): the grammar waits for the end of
    # the thinking (router/reasoning.py gated, shard/grammar.py ThinkingGate). None: it does not.
    thinking: tuple[int, int, bool] | None = None


@dataclass(frozen=True)
class GenerationOptions:
    """One request body's generation settings, whichever API it came in: what `validation.tgi_options`
    (TGI's `parameters`) and `openai_validation.openai_options` (an OpenAI body) each produce, once,
    and `validation.validate` turns into a `ValidRequest` per prompt. Unset knobs are None (the
    server's default applies); the grammar is already checked and serialised."""

    max_new_tokens: int | None = None  # None: the room left in --max-total-tokens
    truncate: int | None = None  # keep only the prompt's last tokens
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0  # TGI's: over the prompt and the generated tokens, by length
    generated_frequency_penalty: float = 0.0  # OpenAI's: times generated
    presence_penalty: float = 0.0  # OpenAI's: once generated
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    best_of: int = 1  # TGI's candidates (OpenAI's choices are expanded by its own handler)
    top_n_tokens: int = 0
    decoder_input_details: bool = False
    details: bool = False
    return_full_text: bool = False
    grammar: GrammarSpec | None = None
    stream: bool = False
    adapter: int = 0  # LoRA adapter slot (router/adapters.py): 0 the base model
    adapter_load: int = 0


@dataclass
class ValidRequest:
    """A request that passed validation: tokenized, truncated, within every limit."""

    input_ids: list[int]
    inputs: str  # the prompt text (after truncation this is still the user's text)
    sampling: SamplingParameters
    stopping: StoppingParameters
    top_n_tokens: int = 0
    decoder_input_details: bool = False  # the shard returns prompt logprobs
    details: bool = False
    return_full_text: bool = False
    images: list[bytes] = field(default_factory=list)  # encoded prompt images (their tokens are in input_ids)
    image_starts: list[int] = field(default_factory=list)  # where each image's placeholder tokens start
    grammar: GrammarSpec | None = None  # constrained generation
    adapter: int = 0  # LoRA adapter slot (router/adapters.py): 0 the base model
    adapter_load: int = 0  # the load of that adapter it was given (AdapterTable: unique per load)


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass
class StreamEvent:
    """One generated token; the last event of a request also carries `end`."""

    token: Token
    top_tokens: list[Token] = field(default_factory=list)
    end: GenerationEnd | None = None


@dataclass
class GenerationEnd:
    finish_reason: FinishReason
    generated_text: str  # all generated text (stop sequence included, as TGI)
    generated_tokens: int
    seed: int | None  # the seed used when sampling, else None
    prefill: list[Token] = field(default_factory=list)  # with decoder_input_details
    queue_time: float = 0.0  # seconds spent waiting in the queue
    inference_time: float = 0.0  # seconds from first prefill to the end


class GenerationError(Exception):
    """The shards failed while generating (HTTP 424, error_type "generation")."""


class OverloadedError(Exception):
    """More requests in flight than --max-concurrent-requests (HTTP 429, "overloaded")."""



class Engine(Protocol):
    """What the HTTP layer calls. The batching engine implements it; tests may fake it."""

    def generate_groups(self, request: ValidRequest) -> AsyncIterator[list[StreamEvent]]:
        """Yield one StreamEvent per generated token, in order, the last one with `end` set;
        each item is a list of the events ready together (the tokens of one decode call), which
        a stream sends in one write.

        Raises OverloadedError before yielding when the server is full, and
        GenerationError if the shards fail. Closing the iterator early (client
        gone) cancels the request and frees its batch slot and KV blocks.
        """
        ...

    def health(self) -> tuple[bool, dict]:
        """(can serve now, JSON body for /health)."""
        ...

    def info(self) -> dict:
        """Engine fields for /info (KV blocks, buckets, ...)."""
        ...

    async def check_grammars(self, requests: list[ValidRequest]) -> None:
        """Returns once every grammar of `requests` is compiled where the requests will run; raises
        ValidationError naming the field a grammar came from when it cannot compile (or not in time)."""
        ...

    def queue_size(self) -> int: ...
