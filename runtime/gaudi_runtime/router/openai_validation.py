"""OpenAI's completion and chat requests -> validated requests for the engine.

The fields TGI also has become TGI `parameters` and pass TGI's checks and limits (`validation`), so
both APIs refuse the same things in the same words. As in TGI, temperature 0 means greedy decoding
and any other temperature (or none) samples. `frequency_penalty` and `presence_penalty` keep OpenAI's
meaning, counted over the generated tokens only; TGI's own `frequency_penalty` (over the prompt too,
divided by the length) is a different knob and stays off here.
"""

from __future__ import annotations

from dataclasses import replace

from gaudi_runtime.config import Config
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
from gaudi_runtime.router.types import ValidRequest
from gaudi_runtime.router.validation import tokenize_input, validate_parameters, validate_with_images


def generate_parameters(req: OpenAIRequest, max_tokens: int | None, **extra) -> GenerateParameters:
    """The TGI parameters of an OpenAI request; `extra` holds the route's own (echo, logprobs)."""
    if req.n != 1:
        raise ValidationError("`n` != 1 is not supported by this server")
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


# --- /v1/completions ------------------------------------------------------------------------------

def completion_requests(req: CompletionRequest, config: Config, tokenizer: RouterTokenizer) -> list[ValidRequest]:
    """One validated request per prompt."""
    if req.best_of is not None and req.best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported on this endpoint")
    extra: dict = {"return_full_text": req.echo}
    if req.logprobs:
        extra["top_n_tokens"] = req.logprobs
    params = generate_parameters(req, req.max_tokens, **extra)
    return [with_openai_penalties(validate_parameters(text, ids, params, config, stream=req.stream).request, req)
            for text, ids in prompts(req.prompt, config, tokenizer)]


def prompts(prompt: str | list[str] | list[int], config: Config,
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
    if len(prompt) > config.max_client_batch_size:
        raise ValidationError(
            f"Number of prompts ({len(prompt)}) exceeds the maximum client batch size "
            f"({config.max_client_batch_size})")
    return [(p, tokenize_input(p, tokenizer)) for p in prompt]


# --- /v1/chat/completions -------------------------------------------------------------------------

def check_chat_schemas(req: ChatCompletionRequest, config: Config) -> None:
    """The JSON schemas a chat request carries (`response_format`, each tool's parameters), bounded
    before the template renders or a grammar compiles them."""
    fields = [("response_format.json_schema", None if req.response_format is None else req.response_format.json_schema)]
    fields += [(f"tools[{i}].function.parameters", t.function.parameters) for i, t in enumerate(req.tools or [])]
    check_json_schemas(fields, config)


def chat_parameters(req: ChatCompletionRequest) -> GenerateParameters:
    extra = {"top_n_tokens": req.top_logprobs} if req.logprobs and req.top_logprobs else {}
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    return generate_parameters(req, max_tokens, **extra)


def chat_prompt(req: ChatCompletionRequest, tokenizer: RouterTokenizer, *, images_allowed: bool) -> str:
    """The conversation rendered by the model's chat template."""
    if req.response_format is not None and req.response_format.type != "text":
        raise ValidationError("grammar is not supported: `response_format` must be absent or of type `text`")
    if req.tool_choice not in (None, "none", "auto"):
        raise ValidationError("tool calling is not supported: `tool_choice` must be `none` or `auto`")
    tools = None
    if req.tools and req.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        return tokenizer.apply_chat_template(chat_messages(req.messages, images_allowed=images_allowed),
                                             tools=tools)
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
        out.append({**m.model_dump(exclude_none=True), "content": content or ""})
    return out


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


def chat_request(prompt: str, images, params: GenerateParameters, req: ChatCompletionRequest, config: Config,
                 tokenizer: RouterTokenizer) -> ValidRequest:
    """The rendered prompt (its special tokens come from the template, none are added) validated."""
    if images is not None:
        job = validate_with_images(prompt, images, params, config, tokenizer, stream=req.stream,
                                   add_special_tokens=False)
    else:
        ids = tokenize_input(prompt, tokenizer, add_special_tokens=False)
        job = validate_parameters(prompt, ids, params, config, stream=req.stream)
    return with_openai_penalties(job.request, req)
