"""Request validation: a TGI body in, a `ValidRequest` out, or a `ValidationError` (HTTP 422)
whose message follows TGI's wording and names the field.

Types and ranges belong to the request models (`request_models`); the checks here are those that
depend on the running server: its limits (`LimitsConfig`) and structured-output settings
(`StructuredOutputConfig`), the tokenizer, streaming. Pure functions apart
from the tokenizer's `encode`. The OpenAI routes come through here too (`openai_validation`), so
both APIs enforce the same limits with the same words.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Protocol

from gaudi_runtime.config import LimitsConfig, StructuredOutputConfig
from gaudi_runtime.params import SamplingParameters, samples
from gaudi_runtime.router.errors import ContextLengthError, ValidationError
from gaudi_runtime.router.request_models import (
    MAX_SEED,
    MAX_U32,
    GenerateParameters,
    GenerateRequest,
    Grammar,
    parse_request,
)
from gaudi_runtime.router.schema_limits import check_json_schemas
from gaudi_runtime.router.tokenizer import TokenizerError
from gaudi_runtime.router.types import GrammarSpec, StoppingParameters, ValidRequest


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
                      images=None) -> GenerateJob:
    """A TGI body `{"inputs": ..., "parameters": {...}}` -> GenerateJob.

    `images`: the prompt's images expanded for a vision model (`router.images.prompt_images`)."""
    request = body if isinstance(body, GenerateRequest) else parse_generate(body)
    if images is not None:
        return validate_with_images(request.inputs, images, request.parameters, limits, structured, tokenizer,
                                    stream=stream, rng=rng)
    input_ids = tokenize_input(request.inputs, tokenizer)
    return validate_parameters(request.inputs, input_ids, request.parameters, limits, structured, stream=stream,
                               rng=rng)


def validate_with_images(inputs: str, images, params: GenerateParameters | dict, limits: LimitsConfig,
                         structured: StructuredOutputConfig, tokenizer: _Encoder, *, stream: bool = False,
                         rng: random.Random | None = None,
                         add_special_tokens: bool = True, grammar: GrammarSpec | None = None) -> GenerateJob:
    """Validate a vision model's prompt: its text with each image expanded into placeholder tokens."""
    input_ids = tokenize_input(images.text, tokenizer, add_special_tokens=add_special_tokens)
    job = validate_parameters(inputs, input_ids, params, limits, structured, stream=stream, rng=rng, grammar=grammar)
    images.attach(job.request, input_ids)
    return job


def validate_parameters(inputs: str, input_ids: list[int], params: GenerateParameters | dict, limits: LimitsConfig,
                        structured: StructuredOutputConfig, *, stream: bool = False,
                        rng: random.Random | None = None,
                        grammar: GrammarSpec | None = None) -> GenerateJob:
    """A tokenized prompt and TGI's parameters (a model, or a dict to parse) -> GenerateJob, within
    the server's `limits`. `grammar`: the OpenAI routes' constraint (TGI's is `params.grammar`)."""
    if not isinstance(params, GenerateParameters):
        params = parse_request(GenerateParameters, params)
    check_limits(params, limits, structured, stream=stream)
    input_ids, max_new_tokens = fit_input(input_ids, params.truncate, params.max_new_tokens, limits)
    best_of = 1 if params.best_of is None else params.best_of
    if params.grammar is not None:
        grammar = grammar_spec(params.grammar)
    request = ValidRequest(
        input_ids=input_ids,
        inputs=inputs,
        sampling=sampling_parameters(params, best_of, rng or random.Random()),
        stopping=StoppingParameters(
            max_new_tokens=max_new_tokens,
            stop_sequences=tuple(params.stop),
            # `ignore_eos` is vLLM's extension (benchmark clients send it); the env var sets it server-wide.
            # A grammar's end is the output's: past it the grammar allows nothing but EOS.
            ignore_eos_token=(limits.text_generation_server_ignore_eos_token or params.ignore_eos)
            and grammar is None,
        ),
        top_n_tokens=params.top_n_tokens or 0,
        decoder_input_details=params.decoder_input_details,
        details=params.details,
        return_full_text=params.return_full_text,
        grammar=grammar,
    )
    return GenerateJob(request=request, best_of=best_of)


# --- the server's limits (pure) ------------------------------------------------------------------------

def check_limits(p: GenerateParameters, limits: LimitsConfig, structured: StructuredOutputConfig, *,
                 stream: bool) -> None:
    """What TGI checks against its launch settings, and what this server does not implement."""
    check_json_schemas([("grammar", None if p.grammar is None else p.grammar.value)], structured)
    _check_best_of(p, limits, stream=stream)
    if stream and p.decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    if len(p.stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(p.stop)}")
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


def grammar_spec(g: Grammar, field: str = "grammar") -> GrammarSpec:
    """TGI's grammar as the shards take it: a JSON schema (an object, or its JSON text) or a regex."""
    if g.type == "regex":
        if not isinstance(g.value, str):
            raise ValidationError(f"`{field}.value`: a regex grammar's value must be a string")
        return GrammarSpec("regex", g.value, field)
    return json_schema_spec(g.value, f"{field}.value", field)


def json_schema_spec(schema: object, where: str, field: str | None = None) -> GrammarSpec:
    """A JSON schema (an object or a boolean, or the JSON text of one) as a grammar; `where` names
    the field in errors, `field` the one named if the shards cannot compile it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValidationError(f"`{where}`: not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValidationError(f"`{where}`: a JSON schema must be an object")
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), field or where)


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


def sampling_parameters(p: GenerateParameters, best_of: int, rng: random.Random) -> SamplingParameters:
    """What the shard's token chooser needs, `do_sample` settled by `params.samples` (best_of > 1
    samples); a request without a seed gets a random one."""
    chosen = SamplingParameters(
        do_sample=p.do_sample or best_of > 1,
        temperature=1.0 if p.temperature is None else p.temperature,
        top_k=p.top_k or 0,
        top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=rng.getrandbits(63) if p.seed is None else p.seed,
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
