"""OpenAI's Responses API, as vLLM serves it: `POST /v1/responses` (whole or streamed),
`GET` and `DELETE /v1/responses/{response_id}`.

A request becomes the chat completions body it means (`responses_convert`) and runs on the chat
path (`openai_api.prepare_chat`: the same validation, prompt, grammars, tool-call parsing and
engine); the chat answer becomes the Response (whole) or the Responses events (`responses_stream`).
Stored responses and `previous_response_id` are `responses_store`'s. Errors are OpenAI's envelope.
"""

from __future__ import annotations

import json

from aiohttp import web

from gaudi_runtime.router import sse
from gaudi_runtime.router.http_common import generate_all, json_response, read_body, recorded, recorder
from gaudi_runtime.router.inference import merge
from gaudi_runtime.router.openai_api import (
    ChatJob,
    _chat_choice,
    _chat_chunk_choice,
    _generated,
    prepare_chat,
    served_name,
)
from gaudi_runtime.router.request_models import parse_request
from gaudi_runtime.router.responses_convert import (
    assistant_messages,
    chat_body,
    new_id,
    output_items,
    response_object,
    status_of,
    usage,
)
from gaudi_runtime.router.responses_models import ResponsesRequest
from gaudi_runtime.router.responses_store import ResponseStore, get_store
from gaudi_runtime.router.responses_stream import ResponsesStream
from gaudi_runtime.router.state import get_state


def _store(store: ResponseStore, req: ResponsesRequest, rid: str, response: dict, conversation: list[dict]) -> None:
    if req.store:
        store.put(rid, response, conversation + assistant_messages(response["output"]))


async def handle_create(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    body = await read_body(request, rec)
    store = get_store(request)
    with recorded(rec):
        req = parse_request(ResponsesRequest, body)
        history = [] if req.previous_response_id is None else \
            store.get(req.previous_response_id, "previous_response_id").conversation
        chat, conversation = chat_body(req, history, req.stream)
    job = await prepare_chat(request, chat, rec)
    state = get_state(request)
    rid, model = new_id("resp"), served_name(state, job.adapter)

    def render(output: list[dict], status: str, usage_: dict | None) -> dict:
        return response_object(rid, req, model, output, status=status, usage_=usage_)

    if req.stream:
        return await _stream(request, job, rec, ResponsesStream(render),
                             lambda final: _store(store, req, rid, final, conversation))
    gens = await generate_all(state, job.reqs, rec)
    rec.success_pending()
    choice = _chat_choice(0, gens[0], job.req, job.fmt, job.thinking)
    counts = _generated(gens)
    response = render(output_items(choice["message"]), status_of(choice["finish_reason"]),
                      usage(counts["prompt_tokens"], counts["completion_tokens"]))
    _store(store, req, rid, response, conversation)
    return json_response(response)


async def _stream(request: web.Request, job: ChatJob, rec, stream: ResponsesStream, keep) -> web.StreamResponse:
    """The chat stream's choice deltas (tool calls parsed as for chat) rendered as Responses events."""
    choice = _chat_chunk_choice(job.req, job.fmt, job.thinking)
    ended = {"finish": None, "generated": 0}

    def render(item):
        _, group = item
        events = stream.start()
        for ev in group:
            if ev.end is not None:
                ended["generated"] += ev.end.generated_tokens
            for text in choice(0, ev):
                chunk = json.loads(text)
                events += stream.delta(chunk["delta"])
                ended["finish"] = chunk["finish_reason"] or ended["finish"]
        return events

    def finish():
        prompt = len(job.reqs[0].input_ids)
        events, final = stream.finish(status_of(ended["finish"]), usage(prompt, ended["generated"]))
        keep(final)
        return events

    return await sse.drive(request, merge(get_state(request), job.reqs, rec), rec, render, finish)


async def handle_get(request: web.Request) -> web.Response:
    return json_response(get_store(request).get(request.match_info["response_id"]).response)


async def handle_delete(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    get_store(request).delete(rid)
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})
