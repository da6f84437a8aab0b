"""Request validation: a JSON body in, a `ValidRequest` out, or a `ValidationError`
(HTTP 422) whose message follows TGI's wording. Pure functions apart from the
tokenizer's `encode`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gaudi_runtime.config import Config
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.types import StoppingParameters, ValidRequest

MAX_SEED = 2**64 - 1


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
    if not isinstance(body, dict):
        raise ValidationError("Failed to deserialize the JSON body: expected a JSON object")
    return body


# --- typed field access -------------------------------------------------------------

def _type_error(name: str, want: str, v: Any) -> ValidationError:
    return ValidationError(f"Failed to deserialize the JSON body: `{name}`: expected {want}, got {json.dumps(v)}")


def opt_int(d: dict, name: str, *, minimum: int | None = None) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _type_error(name, "an integer", v)
    v = int(v)
    if minimum is not None and v < minimum:
        raise _type_error(name, f"an integer >= {minimum}", v)
    return v


def opt_float(d: dict, name: str) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(name, "a number", v)
    return float(v)


def opt_bool(d: dict, name: str, default: bool = False) -> bool:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def str_list(d: dict, *names: str) -> list[str]:
    """A list of strings under the first present name; a single string is a list of one."""
    for name in names:
        v = d.get(name)
        if v is None:
            continue
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise _type_error(name, "a list of strings", v)
        return list(v)
    return []


# --- the TGI parameters ---------------------------------------------------------------

def tokenize_input(inputs: Any, tokenizer: _Encoder, add_special_tokens: bool = True) -> list[int]:
    from gaudi_runtime.router.tokenizer import TokenizerError

    if not isinstance(inputs, str):
        raise _type_error("inputs", "a string", inputs)
    if inputs == "":
        raise ValidationError("`inputs` cannot be empty")
    try:
        return list(tokenizer.encode(inputs, add_special_tokens=add_special_tokens))
    except TokenizerError as e:
        raise ValidationError(f"tokenizer error {e}") from None
    except Exception as e:  # e.g. lone surrogates from a JSON "\ud800" escape
        raise ValidationError(f"tokenizer error {type(e).__name__}: {e}") from None


def validate_generate(body: dict, config: Config, tokenizer: _Encoder, *, stream: bool = False,
                      rng: random.Random | None = None, images=None) -> GenerateJob:
    """A TGI body `{"inputs": ..., "parameters": {...}}` -> GenerateJob.

    `images`: the prompt's images expanded for a vision model (`router.images.prompt_images`)."""
    if "inputs" not in body:
        raise ValidationError("Failed to deserialize the JSON body: missing field `inputs`")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise _type_error("parameters", "an object", params)
    inputs = body["inputs"]
    if images is not None:
        return validate_with_images(inputs, images, params, config, tokenizer, stream=stream, rng=rng)
    input_ids = tokenize_input(inputs, tokenizer)
    return validate_parameters(inputs, input_ids, params, config, stream=stream, rng=rng)


def validate_with_images(inputs: str, images, params: dict, config: Config, tokenizer: _Encoder, *,
                         stream: bool = False, rng: random.Random | None = None,
                         add_special_tokens: bool = True) -> GenerateJob:
    """Validate a vision model's prompt: its text with each image expanded into placeholder tokens."""
    input_ids = tokenize_input(images.text, tokenizer, add_special_tokens=add_special_tokens)
    job = validate_parameters(inputs, input_ids, params, config, stream=stream, rng=rng)
    images.attach(job.request, input_ids)
    return job


def validate_parameters(inputs: str, input_ids: list[int], params: dict, config: Config, *,
                        stream: bool = False, rng: random.Random | None = None) -> GenerateJob:
    """Check TGI's generation parameters against the limits in `config`."""
    rng = rng or random.Random()
    do_sample = opt_bool(params, "do_sample")
    temperature = opt_float(params, "temperature")
    top_k = opt_int(params, "top_k")
    top_p = opt_float(params, "top_p")
    typical_p = opt_float(params, "typical_p")
    repetition_penalty = opt_float(params, "repetition_penalty")
    frequency_penalty = opt_float(params, "frequency_penalty")
    max_new_tokens = opt_int(params, "max_new_tokens")
    truncate = opt_int(params, "truncate")
    seed = opt_int(params, "seed")
    best_of = opt_int(params, "best_of")
    top_n_tokens = opt_int(params, "top_n_tokens")
    stop = str_list(params, "stop", "stop_sequences")
    watermark = opt_bool(params, "watermark")
    details = opt_bool(params, "details")
    decoder_input_details = opt_bool(params, "decoder_input_details")
    return_full_text = opt_bool(params, "return_full_text")

    # Same rule as TGI: any sampling knob that was given means "sampling".
    sampling_requested = do_sample or any(v is not None for v in (temperature, top_k, top_p, typical_p))
    best_of = 1 if best_of is None else best_of
    if best_of != 1:
        if config.max_best_of == 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if best_of < 1 or best_of > config.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {config.max_best_of}. Given: {best_of}")
        if stream:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
        if not sampling_requested:
            raise ValidationError("you must use sampling when `best_of` is > 1")
        if seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
    if stream and decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    if temperature is not None and temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if frequency_penalty is not None and not -2.0 <= frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    # top_p = 1.0 is accepted (means "off"): OpenAI clients send it by default.
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValidationError("`top_p` must be > 0.0 and <= 1.0")
    if typical_p is not None and not 0.0 < typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if top_k is not None and top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(stop) > config.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {config.max_stop_sequences} stop sequences. Given: {len(stop)}")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValidationError(f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {seed}")
    if top_n_tokens is not None and top_n_tokens != 0:
        if config.max_top_n_tokens == 0:
            raise ValidationError(
                "`top_n_tokens` != 0 is not allowed for this endpoint, because `--max-top-n-tokens` is set to 0")
        if not 0 <= top_n_tokens <= config.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {config.max_top_n_tokens}. Given: {top_n_tokens}")
    if watermark:
        raise ValidationError("`watermark` is not supported by this server")
    if params.get("grammar") is not None:
        raise ValidationError("grammar is not supported")
    if params.get("adapter_id") is not None:
        raise ValidationError("`adapter_id` is not supported: this server serves no LoRA adapters")
    if truncate is not None and (truncate <= 0 or truncate > config.max_input_tokens):
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {config.max_input_tokens}. Given: {truncate}")

    if not input_ids:
        raise ValidationError("`inputs` cannot be empty")
    if truncate is not None and len(input_ids) > truncate:
        input_ids = input_ids[-truncate:]  # keep the end of the prompt, as TGI
    input_length = len(input_ids)
    if input_length > config.max_input_tokens:
        raise ValidationError(
            f"`inputs` must have less than {config.max_input_tokens} tokens. Given: {input_length}")
    if max_new_tokens is None:
        max_new_tokens = config.max_total_tokens - input_length
    if input_length + max_new_tokens > config.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {config.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")

    # What the shard's token chooser treats as sampling (TGI: do_sample or any warper).
    sample = do_sample or (temperature is not None and temperature != 1.0) or bool(top_k) or (
        top_p is not None and top_p < 1.0) or (typical_p is not None and typical_p < 1.0) or best_of > 1
    sampling = SamplingParameters(
        do_sample=sample,
        temperature=1.0 if temperature is None else temperature,
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p,
        typical_p=1.0 if typical_p is None else typical_p,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        frequency_penalty=frequency_penalty or 0.0,
        seed=rng.getrandbits(63) if seed is None else seed,
        watermark=False,
    )
    stopping = StoppingParameters(
        max_new_tokens=max_new_tokens,
        stop_sequences=tuple(stop),
        # `ignore_eos` is vLLM's extension (benchmark clients send it); the env var sets it server-wide.
        ignore_eos_token=config.text_generation_server_ignore_eos_token or bool(opt_bool(params, "ignore_eos")),
    )
    request = ValidRequest(
        input_ids=input_ids,
        inputs=inputs,
        sampling=sampling,
        stopping=stopping,
        top_n_tokens=top_n_tokens or 0,
        decoder_input_details=decoder_input_details,
        details=details,
        return_full_text=return_full_text,
    )
    return GenerateJob(request=request, best_of=best_of)


def best_of_requests(job: GenerateJob, rng: random.Random | None = None) -> list[ValidRequest]:
    """One request per best_of candidate, each with its own random seed."""
    if job.best_of == 1:
        return [job.request]
    rng = rng or random.Random()
    return [replace(job.request, sampling=replace(job.request.sampling, seed=rng.getrandbits(63)))
            for _ in range(job.best_of)]
