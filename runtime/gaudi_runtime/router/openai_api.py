"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Requests are mapped to TGI's parameters and validated by the same code as
/generate. As in TGI, temperature 0 means greedy, any other (or none) samples;
stop sequences are kept in the returned text.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

import gaudi_runtime
from gaudi_runtime.router import sse
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.images import prompt_images
from gaudi_runtime.router.inference import Generation, RequestRecorder, check_health, collect_all, merge
from gaudi_runtime.router.state import AppState, get_state
from gaudi_runtime.router.tgi_api import read_body, recorder
from gaudi_runtime.router.tokenizer import TokenizerError
from gaudi_runtime.router.types import FinishReason, StreamEvent, Token
from gaudi_runtime.router.validation import (
    GenerateJob,
    opt_bool,
    opt_float,
    opt_int,
    str_list,
    tokenize_input,
    validate_parameters,
    validate_with_images,
)

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop"}


def _fingerprint() -> str:
    return f"{gaudi_runtime.__version__}-gaudi-serve"


def _model(state: AppState) -> str:
    return state.config.model_name or state.config.model_id


def _dumps(o) -> str:
    return json.dumps(o, ensure_ascii=False)


def _logprob(v: float | None) -> float | None:
    from gaudi_runtime.router.tgi_api import _logprob as lp

    return lp(v)


def tgi_parameters(body: dict, max_tokens_names: tuple[str, ...]) -> dict:
    """OpenAI sampling fields -> TGI `parameters`."""
    n = opt_int(body, "n")
    if n is not None and n != 1:
        raise ValidationError("`n` != 1 is not supported by this server")
    best_of = opt_int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported on this endpoint")
    temperature = opt_float(body, "temperature")
    params: dict = {"details": True}
    if temperature == 0.0:
        params["do_sample"] = False
    else:
        params["do_sample"] = True
        params["temperature"] = temperature
    for name in max_tokens_names:
        v = opt_int(body, name)
        if v is not None:
            params["max_new_tokens"] = v
            break
    params["top_p"] = opt_float(body, "top_p")
    params["seed"] = opt_int(body, "seed")
    params["frequency_penalty"] = opt_float(body, "frequency_penalty")
    params["repetition_penalty"] = opt_float(body, "repetition_penalty")
    params["stop"] = str_list(body, "stop")
    opt_float(body, "presence_penalty")  # accepted, type-checked, not applied
    params["ignore_eos"] = opt_bool(body, "ignore_eos")
    return params


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = opt_bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ValidationError("Failed to deserialize the JSON body: `stream_options`: expected an object")
    return stream, bool(opts.get("include_usage"))


def _usage(gens_or_pairs: list[tuple[int, int]]) -> dict:
    p = sum(a for a, _ in gens_or_pairs)
    c = sum(b for _, b in gens_or_pairs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# --- /v1/completions ---------------------------------------------------------------------

def _prompts(state: AppState, body: dict) -> list[tuple[str, list[int]]]:
    if "prompt" not in body:
        raise ValidationError("Failed to deserialize the JSON body: missing field `prompt`")
    prompt = body["prompt"]
    tok = state.tokenizer
    if isinstance(prompt, str):
        return [(prompt, tokenize_input(prompt, tok))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [(tok.decode(prompt), list(prompt))]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) for p in prompt):
        raise ValidationError("`prompt` must be a string, a non-empty list of strings, or a list of token ids")
    if len(prompt) > state.config.max_client_batch_size:
        raise ValidationError(
            f"Number of prompts ({len(prompt)}) exceeds the maximum client batch size "
            f"({state.config.max_client_batch_size})")
    return [(p, tokenize_input(p, tok)) for p in prompt]


def _completion_logprobs(g: Generation | None, tokens: list[Token], tops: list[list[Token]],
                         offset: int = 0) -> dict:
    text_offset, pos = [], offset
    for t in tokens:
        text_offset.append(pos)
        pos += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": [{t.text: _logprob(t.logprob) for t in ts} for ts in tops],
        "text_offset": text_offset,
    }


async def run_completions(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    try:
        stream, include_usage = _stream_flags(body)
        params = tgi_parameters(body, ("max_tokens",))
        logprobs = opt_int(body, "logprobs")
        if logprobs is not None and logprobs > 0:
            params["top_n_tokens"] = logprobs
        echo = opt_bool(body, "echo")
        params["return_full_text"] = echo
        jobs: list[GenerateJob] = [
            validate_parameters(text, ids, params, state.config, stream=stream)
            for text, ids in _prompts(state, body)
        ]
        reqs = [j.request for j in jobs]
        rec.validated(reqs)
        check_health(state)
    except Exception as e:
        rec.failure(e)
        raise
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), _model(state)
    want_logprobs = logprobs is not None

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": _fingerprint(), "choices": choices, "usage": usage}

    if not stream:
        try:
            gens = await collect_all(state, reqs, rec)
        except Exception as e:
            rec.failure(e)
            raise
        choices = []
        for i, g in enumerate(gens):
            text = g.end.generated_text
            if echo:
                text = g.request.inputs + text
            choices.append({
                "index": i, "text": text,
                "logprobs": _completion_logprobs(g, g.tokens, g.top_tokens) if want_logprobs else None,
                "finish_reason": FINISH[g.end.finish_reason],
            })
        rec.success_pending()
        usage = _usage([(len(g.request.input_ids), g.end.generated_tokens) for g in gens])
        return web.json_response(chunk(choices, usage), dumps=_dumps)

    counts: list[tuple[int, int]] = []
    echoed: set[int] = set()

    def render(item: tuple[int, StreamEvent]) -> list[dict]:
        i, ev = item
        text = "" if ev.token.special else ev.token.text
        if echo and i not in echoed:
            echoed.add(i)
            text = reqs[i].inputs + text
        finish = None
        if ev.end is not None:
            finish = FINISH[ev.end.finish_reason]
            counts.append((len(reqs[i].input_ids), ev.end.generated_tokens))
        lp = _completion_logprobs(None, [ev.token], [list(ev.top_tokens)]) if want_logprobs else None
        return [chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}])]

    def finish() -> list:
        out: list = []
        if include_usage:
            out.append(chunk([], _usage(counts)))
        out.append("[DONE]")
        return out

    return await sse.drive(request, merge(state, reqs, rec), rec, render, finish)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_completions(request, await read_body(request, rec), rec)


# --- /v1/chat/completions ----------------------------------------------------------------

def _content_part(i: int, p, images_allowed: bool) -> str:
    """One part of a message's content list -> prompt text; an image becomes TGI's markdown `![](url)`."""
    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
        return p["text"]
    if isinstance(p, dict) and p.get("type") == "image_url":
        if not images_allowed:
            raise ValidationError(f"`messages[{i}].content`: only text parts are supported: this model takes no images")
        url = p.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise ValidationError(f"`messages[{i}].content`: an `image_url` part needs a string `url`")
        return f"![]({url})"
    raise ValidationError(f"`messages[{i}].content`: only text and image_url parts are supported")


def _messages(body: dict, images_allowed: bool = False) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValidationError("Failed to deserialize the JSON body: `messages` must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationError(f"`messages[{i}]` must be an object with a string `role`")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_content_part(i, p, images_allowed) for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValidationError(f"`messages[{i}].content` must be a string or a list of text parts")
        out.append({**m, "content": content if content is not None else ""})
    return out


def _chat_logprobs(tokens: list[Token], tops: list[list[Token]]) -> dict:
    content = []
    for t, ts in zip(tokens, tops, strict=False):
        content.append({
            "token": t.text, "logprob": _logprob(t.logprob),
            "bytes": list(t.text.encode("utf-8")),
            "top_logprobs": [{"token": x.text, "logprob": _logprob(x.logprob),
                              "bytes": list(x.text.encode("utf-8"))} for x in ts],
        })
    return {"content": content}


async def run_chat(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    try:
        stream, include_usage = _stream_flags(body)
        params = tgi_parameters(body, ("max_completion_tokens", "max_tokens"))
        want_logprobs = opt_bool(body, "logprobs")
        top_logprobs = opt_int(body, "top_logprobs")
        if want_logprobs and top_logprobs:
            params["top_n_tokens"] = top_logprobs
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise ValidationError("grammar is not supported: `response_format` must be absent or of type `text`")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "none", "auto"):
            raise ValidationError("tool calling is not supported: `tool_choice` must be `none` or `auto`")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValidationError("Failed to deserialize the JSON body: `tools` must be a list")
        messages = _messages(body, images_allowed=state.images is not None)
        try:
            prompt = state.tokenizer.apply_chat_template(messages, tools=tools if tool_choice != "none" else None)
        except TokenizerError as e:
            raise ValidationError(str(e)) from None
        images = await prompt_images(state, prompt)
        if images is not None:
            job = validate_with_images(prompt, images, params, state.config, state.tokenizer, stream=stream,
                                       add_special_tokens=False)
        else:
            ids = tokenize_input(prompt, state.tokenizer, add_special_tokens=False)
            job = validate_parameters(prompt, ids, params, state.config, stream=stream)
        req = job.request
        rec.validated([req])
        check_health(state)
    except Exception as e:
        rec.failure(e)
        raise
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), _model(state)

    if not stream:
        try:
            (g,) = await collect_all(state, [req], rec)
        except Exception as e:
            rec.failure(e)
            raise
        rec.success_pending()
        return web.json_response({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": _fingerprint(),
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": g.end.generated_text},
                "logprobs": _chat_logprobs(g.tokens, g.top_tokens) if want_logprobs else None,
                "finish_reason": FINISH[g.end.finish_reason],
            }],
            "usage": _usage([(len(req.input_ids), g.end.generated_tokens)]),
        }, dumps=_dumps)

    counts: list[tuple[int, int]] = []

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": _fingerprint(), "choices": choices, "usage": usage}

    def render(item: tuple[int, StreamEvent]) -> list[dict]:
        _, ev = item
        finish = None
        if ev.end is not None:
            finish = FINISH[ev.end.finish_reason]
            counts.append((len(req.input_ids), ev.end.generated_tokens))
        delta = {"role": "assistant", "content": "" if ev.token.special else ev.token.text}
        lp = _chat_logprobs([ev.token], [list(ev.top_tokens)]) if want_logprobs else None
        return [chunk([{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}])]

    def finish() -> list:
        out: list = []
        if include_usage:
            out.append(chunk([], _usage(counts)))
        out.append("[DONE]")
        return out

    return await sse.drive(request, merge(state, [req], rec), rec, render, finish)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_chat(request, await read_body(request, rec), rec)


async def handle_models(request: web.Request) -> web.Response:
    state = get_state(request)
    return web.json_response({"object": "list", "data": [{
        "id": _model(state), "object": "model", "created": int(state.started), "owned_by": "gaudi-serve",
    }]})


