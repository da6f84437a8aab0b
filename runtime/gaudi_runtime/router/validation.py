"""Request validation: a TGI body in, its `GenerationOptions` (parsed once), a `ValidRequest` out,
or a `ValidationError` (HTTP 422) whose message follows TGI's wording and names the field.

Types and ranges belong to the request models (`request_models`); the checks here are those that
depend on the running server: its limits (`LimitsConfig`) and structured-output settings
(`StructuredOutputConfig`), the tokenizer, streaming. Pure functions apart
from the tokenizer's `encode`. The OpenAI routes parse their bodies into the same options
(`openai_validation`) and end in the same `validate`, so both APIs enforce the same limits with the
same words.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Protocol

from gaudi_runtime.config import LimitsConfig, StructuredOutputConfig
from gaudi_runtime.params import SamplingParameters, samples
from gaudi_runtime.router.errors import ContextLengthError, ValidationError
from gaudi_runtime.router.reasoning import ThinkingTokens, gated
from gaudi_runtime.router.request_models import (
    MAX_SEED,
    MAX_U32,
    GenerateParameters,
    GenerateRequest,
    Grammar,
    parse_request,
)
from gaudi_runtime.router.schema_limits import MeasuredSchema, compact, measure
from gaudi_runtime.router.tokenizer import TokenizerError
from gaudi_runtime.router.types import GenerationOptions, GrammarSpec, StoppingParameters, ValidRequest


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class GenerateJob:
    """A validated request, and how many sequences to sample for best_of."""

    request: ValidRequest
    best_of: int = 1


def parse_json_body(raw: bytes) -> dict:
    """Bytes of a request body -> a JSON object (else ValidationError)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(f"Failed to parse the request body: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValidationError("Failed to parse the request body as JSON: the body is empty")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(f"Failed to parse the request body as JSON: {e}") from None
    except RecursionError:
        raise ValidationError("Failed to parse the request body as JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ValidationError("Failed to deserialize the JSON body: expected a JSON object")
    return body


def parse_generate(body: dict) -> GenerateRequest:
    """A TGI body as its model; errors name the parameters as TGI does, without `parameters.`."""
    return parse_request(GenerateRequest, body, unnamed=("parameters",))


def tokenize_input(inputs: str, tokenizer: _Encoder, add_special_tokens: bool = True) -> list[int]:
    if inputs == "":
        raise ValidationError("`inputs` cannot be empty")
    try:
        return list(tokenizer.encode(inputs, add_special_tokens=add_special_tokens))
    except TokenizerError as e:
        raise ValidationError(f"tokenizer error {e}") from None
    except Exception as e:  # e.g. lone surrogates from a JSON "\ud800" escape
        raise ValidationError(f"tokenizer error {type(e).__name__}: {e}") from None


def validate_generate(body: dict | GenerateRequest, limits: LimitsConfig, structured: StructuredOutputConfig,
                      tokenizer: _Encoder, *, stream: bool = False, rng: random.Random | None = None,
                      images=None, thinking: ThinkingTokens | None = None,
                      adapter: tuple[int, int] = (0, 0)) -> GenerateJob:
    """A TGI body `{"inputs": ..., "parameters": {...}}` -> GenerateJob.

    `images`: the prompt's images expanded for a vision model (`router.images.prompt_images`);
    `thinking`: a reasoning model's markers; `adapter`: the (slot, load) `parameters.adapter_id` names."""
    request = body if isinstance(body, GenerateRequest) else parse_generate(body)
    input_ids = tokenize_input(request.inputs if images is None else images.text, tokenizer)
    options = tgi_options(request.parameters, limits, structured, stream=stream, adapter=adapter)
    valid = validate(request.inputs, input_ids, options, limits, images=images, thinking=thinking, rng=rng)
    return GenerateJob(request=valid, best_of=options.best_of)


def tgi_options(p: GenerateParameters, limits: LimitsConfig, structured: StructuredOutputConfig, *,
                stream: bool = False, adapter: tuple[int, int] = (0, 0)) -> GenerationOptions:
    """TGI's `parameters` as the typed options, checked against the server's limits."""
    measured = None if p.grammar is None else measure(p.grammar.value, "grammar", structured)
    check_limits(p, limits, structured, stream=stream)
    return GenerationOptions(
        max_new_tokens=p.max_new_tokens, truncate=p.truncate, do_sample=p.do_sample, temperature=p.temperature,
        top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0, seed=p.seed, stop=tuple(p.stop), ignore_eos=p.ignore_eos,
        best_of=1 if p.best_of is None else p.best_of, top_n_tokens=p.top_n_tokens or 0,
        decoder_input_details=p.decoder_input_details, details=p.details, return_full_text=p.return_full_text,
        grammar=None if p.grammar is None else grammar_spec(p.grammar, measured), stream=stream,
        adapter=adapter[0], adapter_load=adapter[1])


def validate(inputs: str, input_ids: list[int], options: GenerationOptions, limits: LimitsConfig, *,
             images=None, thinking: ThinkingTokens | None = None,
             rng: random.Random | None = None) -> ValidRequest:
    """A tokenized prompt and its body's options -> the request the engine runs, within `limits`.
    `images`: the prompt's images, whose placeholder tokens `input_ids` holds; `thinking`: a
    reasoning model's markers, which the grammar waits for unless the prompt closed the thinking."""
    o = options
    ids, max_new_tokens = fit_input(input_ids, o.truncate, o.max_new_tokens, limits)
    shown, starts = images.place(ids, len(input_ids)) if images is not None else ([], [])
    return ValidRequest(
        input_ids=ids,
        inputs=inputs,
        sampling=sampling_parameters(o, rng or random.Random()),
        stopping=StoppingParameters(
            max_new_tokens=max_new_tokens,
            stop_sequences=o.stop,
            # `ignore_eos` is vLLM's extension (benchmark clients send it); the env var sets it server-wide.
            # A grammar's end is the output's: past it the grammar allows nothing but EOS.
            ignore_eos_token=(limits.text_generation_server_ignore_eos_token or o.ignore_eos) and o.grammar is None,
        ),
        top_n_tokens=o.top_n_tokens,
        decoder_input_details=o.decoder_input_details,
        details=o.details,
        return_full_text=o.return_full_text,
        images=shown,
        image_starts=starts,
        grammar=gated(thinking, inputs, o.grammar),
        adapter=o.adapter,
        adapter_load=o.adapter_load,
    )


# --- the server's limits (pure) ------------------------------------------------------------------------

def check_limits(p: GenerateParameters, limits: LimitsConfig, structured: StructuredOutputConfig, *,
                 stream: bool) -> None:
    """What TGI checks against its launch settings, and what this server does not implement."""
    _check_best_of(p, limits, stream=stream)
    if stream and p.decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    check_stop(p.stop, limits)
    if p.top_n_tokens is not None and p.top_n_tokens != 0:
        if limits.max_top_n_tokens == 0:
            raise ValidationError(
                "`top_n_tokens` != 0 is not allowed for this endpoint, because `--max-top-n-tokens` is set to 0")
        if not 0 <= p.top_n_tokens <= limits.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {p.top_n_tokens}")
    if p.top_k is not None and p.top_k > MAX_U32:
        raise ValidationError(f"Failed to deserialize the JSON body: `top_k`: expected a 32-bit unsigned integer, "
                              f"got {p.top_k}")
    if p.watermark:
        raise ValidationError("`watermark` is not supported by this server")
    if p.grammar is not None and structured.disable_grammar_support:
        raise ValidationError("grammar is not supported")
    if p.truncate is not None and (p.truncate <= 0 or p.truncate > limits.max_input_tokens):
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. Given: {p.truncate}")


def check_stop(stop: list[str], limits: LimitsConfig) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(stop)}")


def grammar_spec(g: Grammar, measured: MeasuredSchema, field: str = "grammar") -> GrammarSpec:
    """TGI's grammar as the shards take it: a JSON schema (an object, or its JSON text) or a regex;
    `measured`: its value as the size limits read it."""
    if g.type == "regex":
        if not isinstance(g.value, str):
            raise ValidationError(f"`{field}.value`: a regex grammar's value must be a string")
        return GrammarSpec("regex", g.value, field)
    return json_schema_spec(measured, f"{field}.value", field)


def json_schema_spec(schema: MeasuredSchema, where: str, field: str | None = None) -> GrammarSpec:
    """A JSON schema (an object or a boolean, or the JSON text of one), measured against the limits,
    as a grammar: its compact text, written once (by the measuring, for an object). `where` names
    the field in errors, `field` the one named if the shards cannot compile it."""
    if schema.error is not None:
        raise ValidationError(f"`{where}`: not valid JSON: {schema.error}")
    if not isinstance(schema.value, dict | bool):
        raise ValidationError(f"`{where}`: a JSON schema must be an object")
    text = schema.text if schema.text is not None else compact(schema.value)
    return GrammarSpec("json", text, field or where)


def _sampling_requested(p: GenerateParameters) -> bool:
    """TGI's validation rule for best_of: any sampling knob given, even at its neutral value, counts as
    asking for sampling (the token chooser's own rule is `params.samples`)."""
    return p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))


def _check_best_of(p: GenerateParameters, limits: LimitsConfig, *, stream: bool) -> None:
    if p.best_of is None or p.best_of == 1:
        return
    if limits.max_best_of == 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
    if p.best_of < 1 or p.best_of > limits.max_best_of:
        raise ValidationError(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {p.best_of}")
    if stream:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if not _sampling_requested(p):
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if p.seed is not None:
        raise ValidationError("`seed` must not be set when `best_of` > 1")


def fit_input(input_ids: list[int], truncate: int | None, max_new_tokens: int | None,
              limits: LimitsConfig) -> tuple[list[int], int]:
    """The prompt cut to `truncate` (its end, as TGI), and `max_new_tokens` (by default all the room
    left), both within `max_input_tokens` and `max_total_tokens`."""
    if not input_ids:
        raise ValidationError("`inputs` cannot be empty")
    if truncate is not None and len(input_ids) > truncate:
        input_ids = input_ids[-truncate:]
    input_length = len(input_ids)
    if input_length > limits.max_input_tokens:
        raise ContextLengthError(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}",
            f"This model's maximum context length is {limits.max_input_tokens} tokens. However, your request "
            f"has {input_length} input tokens. Please reduce the length of the input messages.")
    if max_new_tokens is None:
        max_new_tokens = limits.max_total_tokens - input_length
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise ContextLengthError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_new_tokens}. This model's maximum "
            f"context length is {limits.max_total_tokens} tokens and your request has {input_length} input "
            f"tokens ({max_new_tokens} > {limits.max_total_tokens} - {input_length}).")
    return input_ids, max_new_tokens


def sampling_parameters(o: GenerationOptions, rng: random.Random) -> SamplingParameters:
    """What the shard's token chooser needs, `do_sample` settled by `params.samples` (best_of > 1
    samples); a request without a seed gets a random one."""
    chosen = SamplingParameters(
        do_sample=o.do_sample or o.best_of > 1,
        temperature=1.0 if o.temperature is None else o.temperature,
        top_k=o.top_k or 0,
        top_p=1.0 if o.top_p is None else o.top_p,
        typical_p=1.0 if o.typical_p is None else o.typical_p,
        repetition_penalty=1.0 if o.repetition_penalty is None else o.repetition_penalty,
        frequency_penalty=o.frequency_penalty,
        generated_frequency_penalty=o.generated_frequency_penalty,
        presence_penalty=o.presence_penalty,
        seed=rng.getrandbits(63) if o.seed is None else o.seed,
    )
    return replace(chosen, do_sample=samples(chosen))


def per_choice_requests(request: ValidRequest, n: int, seeded: bool,
                        rng: random.Random | None = None) -> list[ValidRequest]:
    """`n` sequences for one prompt (TGI's best_of candidates, OpenAI's n choices), each an ordinary
    request with a seed of its own: the client's seed plus the index when it gave one (reproducible),
    else random ones."""
    if n == 1:
        return [request]
    rng = rng or random.Random()
    seed = request.sampling.seed
    return [replace(request, sampling=replace(request.sampling,
                                              seed=(seed + i) & MAX_SEED if seeded else rng.getrandbits(63)))
            for i in range(n)]


def best_of_requests(job: GenerateJob, rng: random.Random | None = None) -> list[ValidRequest]:
    """One request per best_of candidate (validation refuses a client seed with best_of > 1)."""
    return per_choice_requests(job.request, job.best_of, seeded=False, rng=rng)
