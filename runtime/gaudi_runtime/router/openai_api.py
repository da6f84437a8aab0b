"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Requests are parsed by the OpenAI request models and validated by the same rules as /generate
(`openai_validation`); this module turns the engine's tokens into OpenAI's response and stream
shapes. Stop sequences stay in the returned text, as TGI does.

Several choices (`n`, and `best_of` on completions) are ordinary requests, one per choice with a
seed of its own, run together and gathered here. With tools, each choice's output is parsed into
`tool_calls` in the model's format (`tool_calls`), as a whole or as stream deltas. With
--reasoning-parser, a chat answer's thinking goes in `reasoning` and only what follows it is the
content (and parsed for tool calls): `reasoning`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

import gaudi_runtime
from gaudi_runtime.router import adapters, json_text, reasoning, sse
from gaudi_runtime.router.http_common import (
    admit,
    finite_logprob,
    generate_all,
    json_response,
    model_name,
    read_body,
    recorded,
    recorder,
)
from gaudi_runtime.router.images import prompt_images
from gaudi_runtime.router.inference import Generation, RequestRecorder, merge
from gaudi_runtime.router.openai_validation import (
    ChatBody,
    chat_limits,
    chat_prompt,
    chat_requests,
    chat_tools,
    check_chat_schemas,
    completion_requests,
)
from gaudi_runtime.router.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    parse_request,
)
from gaudi_runtime.router.state import AppState, get_state
from gaudi_runtime.router.tool_calls import MARKERS, ToolCallStream, parse, tool_calls_json
from gaudi_runtime.router.types import FinishReason, StreamEvent, Token, ValidRequest

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop"}
FINGERPRINT = f"{gaudi_runtime.__version__}-gaudi-serve"


@dataclass
class Envelope:
    """The fields that every response and stream chunk of one request repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, object_type: str, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": choices, "usage": usage}

    def chunk_template(self, object_type: str) -> tuple[str, str]:
        """The JSON text of `wrap(object_type, [choice])` before and after the choice's own."""
        head = json_text.dumps({"id": self.id, "object": object_type, "created": self.created, "model": self.model,
                                "system_fingerprint": FINGERPRINT})
        return head[:-1] + ', "choices": [', '], "usage": null}'


def usage(reqs: list[ValidRequest], completion_tokens: int) -> dict:
    """OpenAI's usage: each prompt counted once, however many choices it has."""
    p = sum(len(ids) for ids in {id(r.input_ids): r.input_ids for r in reqs}.values())
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def _generated(gens: list[Generation]) -> dict:
    return usage([g.request for g in gens], sum(g.end.generated_tokens for g in gens))


def _include_usage(req: OpenAIRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def _stream(request: web.Request, reqs: list[ValidRequest], req: OpenAIRequest, rec: RequestRecorder,
                  envelope: Envelope, object_type: str, choice) -> web.StreamResponse:
    """Stream the requests' tokens as chunks of `object_type`; `choice(i, event)` renders the choices
    one token of request i gives, as JSON text (one chunk each). Usage (when asked for) and `[DONE]`
    follow the last chunk."""
    generated = 0
    before, after = envelope.chunk_template(object_type)

    def render(item: tuple[int, list[StreamEvent]]):
        nonlocal generated
        i, group = item
        for ev in group:
            if ev.end is not None:
                generated += ev.end.generated_tokens
            for c in choice(i, ev):
                yield before + c + after

    def finish() -> list:
        return ([envelope.wrap(object_type, [], usage(reqs, generated))] if _include_usage(req) else []) + ["[DONE]"]

    return await sse.drive(request, merge(get_state(request), reqs, rec), rec, render, finish)


# --- /v1/completions -----------------------------------------------------------------------------

def completion_logprobs(tokens: list[Token], tops: list[list[Token]], offset: int = 0) -> dict:
    text_offset, pos = [], offset
    for t in tokens:
        text_offset.append(pos)
        pos += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [finite_logprob(t.logprob) for t in tokens],
        "top_logprobs": [{t.text: finite_logprob(t.logprob) for t in ts} for ts in tops],
        "text_offset": text_offset,
    }


def best_choices(gens: list[Generation], n: int) -> list[Generation]:
    """Per prompt (its sequences are consecutive), the `n` with the highest mean log-probability per
    token, best first (OpenAI's `best_of`); all of them, in order, when there are `n`."""
    per_prompt = len(gens) // max(1, len({id(g.request.input_ids) for g in gens}))
    if per_prompt == n:
        return gens
    out = []
    for k in range(0, len(gens), per_prompt):
        group = gens[k:k + per_prompt]
        out += sorted(group, key=lambda g: g.logprob_sum / max(1, len(g.tokens)), reverse=True)[:n]
    return out


def _completion_choice(i: int, g: Generation, req: CompletionRequest) -> dict:
    return {
        "index": i,
        "text": g.request.inputs + g.end.generated_text if req.echo else g.end.generated_text,
        "logprobs": completion_logprobs(g.tokens, g.top_tokens) if req.logprobs is not None else None,
        "finish_reason": FINISH[g.end.finish_reason],
    }


def _finish_text(ev: StreamEvent) -> str:
    return "null" if ev.end is None else json_text.string(FINISH[ev.end.finish_reason])


def _completion_chunk_choice(reqs: list[ValidRequest], req: CompletionRequest):
    echoed: set[int] = set()

    def choice(i: int, ev: StreamEvent) -> list[str]:
        text = "" if ev.token.special else ev.token.text
        if req.echo and i not in echoed:
            echoed.add(i)
            text = reqs[i].inputs + text
        lp = json_text.dumps(completion_logprobs([ev.token], [list(ev.top_tokens)])) \
            if req.logprobs is not None else "null"
        return [f'{{"index": {i}, "text": {json_text.string(text)}, "logprobs": {lp}, '
                f'"finish_reason": {_finish_text(ev)}}}']

    return choice


async def run_completions(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    limits, structured = state.config.limits, state.config.structured_output
    with recorded(rec):
        req = parse_request(CompletionRequest, body)
        index, load = adapters.openai_adapter(state.adapters, req.model)
        reqs = completion_requests(req, limits, structured, state.tokenizer, adapter=(index, load),
                                   thinking=state.thinking)
        await admit(state, rec, reqs)
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", served_name(state, index))
    if req.stream:
        return await _stream(request, reqs, req, rec, envelope, "text_completion",
                             _completion_chunk_choice(reqs, req))
    gens = await generate_all(state, reqs, rec)
    rec.success_pending()
    choices = [_completion_choice(i, g, req) for i, g in enumerate(best_choices(gens, req.n))]
    return json_response(envelope.wrap("text_completion", choices, _generated(gens)))


async def handle_completions(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_completions(request, await read_body(request, rec), rec)


# --- /v1/chat/completions -------------------------------------------------------------------------

def chat_logprobs(tokens: list[Token], tops: list[list[Token]]) -> dict:
    content = []
    for t, ts in zip(tokens, tops, strict=False):
        content.append({
            "token": t.text, "logprob": finite_logprob(t.logprob),
            "bytes": list(t.text.encode("utf-8")),
            "top_logprobs": [{"token": x.text, "logprob": finite_logprob(x.logprob),
                              "bytes": list(x.text.encode("utf-8"))} for x in ts],
        })
    return {"content": content}


def _kept(fmt: str | None, thinking: str | None) -> tuple[str, ...]:
    """The special tokens the parsers read: the tool-call format's markers, the thinking's."""
    return (MARKERS[fmt] if fmt is not None else ()) + (reasoning.MARKERS if thinking is not None else ())


def _raw_text(tokens: list[Token], kept: tuple[str, ...]) -> str:
    """The output as the parsers read it: special tokens left out, but for their markers."""
    return "".join(t.text for t in tokens if not t.special or t.text in kept)


def _chat_choice(i: int, g: Generation, req: ChatCompletionRequest, fmt: str | None, thinking: str | None) -> dict:
    message: dict = {"role": "assistant", "content": g.end.generated_text}
    answer = _raw_text(g.tokens, _kept(fmt, None)) if fmt is not None else None
    if thinking is not None:  # the answer after the thinking; null when the thinking took the whole output
        message["reasoning"], answer = reasoning.split(thinking, _raw_text(g.tokens, _kept(fmt, thinking)))
        message["content"] = answer or (None if message["reasoning"] is not None else "")
    finish = FINISH[g.end.finish_reason]
    if fmt is not None:
        parsed = parse(fmt, answer, final=True)
        calls = tool_calls_json(parsed.calls)
        if calls:
            message.update(content=parsed.content if parsed.content.strip() else None, tool_calls=calls)
            finish = "tool_calls" if finish == "stop" else finish
    return {"index": i, "message": message,
            "logprobs": chat_logprobs(g.tokens, g.top_tokens) if req.logprobs else None, "finish_reason": finish}


def _chat_chunk_choice(req: ChatCompletionRequest, fmt: str | None, thinking: str | None):
    streams: dict = {}  # per choice, its ToolCallStream or reasoning.ReasoningStream
    unsent: dict[int, list[dict]] = {}  # per choice, the log-probabilities of tokens no chunk carried yet
    kept = _kept(fmt, thinking)

    def stream():
        tools = ToolCallStream(fmt) if fmt is not None else None
        return tools if thinking is None else reasoning.ReasoningStream(reasoning.Split(thinking), tools)

    def choice(i: int, ev: StreamEvent) -> list[str]:
        lp = chat_logprobs([ev.token], [list(ev.top_tokens)]) if req.logprobs else None
        if fmt is None and thinking is None:
            content = json_text.string("" if ev.token.special else ev.token.text)
            return [f'{{"index": {i}, "delta": {{"role": "assistant", "content": {content}}}, '
                    f'"logprobs": {json_text.dumps(lp)}, "finish_reason": {_finish_text(ev)}}}']
        if i not in streams:
            streams[i] = stream()
        return [json_text.dumps(c) for c in _tool_chunks(i, ev, streams[i], unsent.setdefault(i, []), lp, kept)]

    return choice


def _tool_chunks(i: int, ev: StreamEvent, stream, unsent: list[dict], lp: dict | None,
                 kept: tuple[str, ...]) -> list[dict]:
    """The chunks one token gives a choice whose output is parsed (for tool calls, for its thinking):
    none while the parsers hold the text back, one per delta they then give, and the one ending the choice. Each
    token's log-probability goes out once, with the first chunk at or after it, so that the chunks'
    add up to the whole answer's."""
    if lp is not None:
        unsent += lp["content"]

    def logprobs() -> dict | None:
        taken = {"content": unsent[:]} if unsent else None
        unsent.clear()
        return taken

    text = ev.token.text if not ev.token.special or ev.token.text in kept else ""
    out = [{"index": i, "delta": {"role": "assistant", **d}, "logprobs": logprobs(), "finish_reason": None}
           for d in stream.add(text, final=ev.end is not None)]
    if ev.end is not None:
        finish = FINISH[ev.end.finish_reason]
        finish = "tool_calls" if finish == "stop" and stream.called else finish
        out.append({"index": i, "delta": {}, "logprobs": logprobs(), "finish_reason": finish})
    return out


@dataclass
class ChatJob:
    """A chat request parsed, validated and admitted: what generating and answering it needs (also
    the Responses API's, which runs on this path: `responses_api`)."""

    req: ChatCompletionRequest
    reqs: list[ValidRequest]
    fmt: str | None  # the tool-call format its output is parsed in, when it has tools
    adapter: int  # its adapter's index (router/adapters.py; 0: the base model)
    thinking: str | None = None  # where its output starts (reasoning.start_state), with a reasoning parser


async def prepare_chat(request: web.Request, body: dict, rec: RequestRecorder) -> ChatJob:
    state = get_state(request)
    limits, structured = state.config.limits, state.config.structured_output
    with recorded(rec):
        req = parse_request(ChatCompletionRequest, body)
        index, load = adapters.openai_adapter(state.adapters, req.model)
        measured = check_chat_schemas(req, structured)
        max_tokens, top = chat_limits(req, limits)
        tools = chat_tools(req, structured, state.tokenizer.chat_template)
        chat = ChatBody(req, measured, max_tokens, top, tools, (index, load))
        prompt = chat_prompt(req, state.tokenizer, tools, images_allowed=state.images is not None)
        images = await prompt_images(state, prompt)
        thinking = reasoning.start_state(state.thinking.parser, prompt) if state.thinking is not None else None
        reqs = chat_requests(prompt, images, chat, limits, structured, state.tokenizer, state.thinking)
        await admit(state, rec, reqs)
    return ChatJob(req, reqs, tools.fmt, index, thinking)


async def run_chat(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    job = await prepare_chat(request, body, rec)
    req, reqs = job.req, job.reqs
    envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", served_name(state, job.adapter))
    if req.stream:
        return await _stream(request, reqs, req, rec, envelope, "chat.completion.chunk",
                             _chat_chunk_choice(req, job.fmt, job.thinking))
    gens = await generate_all(state, reqs, rec)
    rec.success_pending()
    choices = [_chat_choice(i, g, req, job.fmt, job.thinking) for i, g in enumerate(gens)]
    return json_response(envelope.wrap("chat.completion", choices, _generated(gens)))


async def handle_chat(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_chat(request, await read_body(request, rec), rec)


def served_name(state: AppState, index: int) -> str:
    """The `model` of a response: the adapter's name, else the base model's."""
    return state.adapters.name(index) or model_name(state)


async def handle_models(request: web.Request) -> web.Response:
    """The base model, then each adapter as a model of its own whose `parent` is the base (vLLM's list)."""
    state = get_state(request)
    card = {"object": "model", "created": int(state.started), "owned_by": "gaudi-serve"}
    base = model_name(state)
    data = [{"id": base, **card, "root": state.config.model.model_id, "parent": None}]
    data += [{"id": a.name, **card, "root": a.source, "parent": base} for a in state.adapters.served()]
    return web.json_response({"object": "list", "data": data})
