"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (router/adapter_updates.py
does the work), in vLLM's shapes: bodies `{"lora_name", "lora_path", "load_inplace"}` and
`{"lora_name"}`; a success is 200 with a line of text, a refusal vLLM's error object
`{"error": {"message", "type", "param", "code"}}` (400 bad input, 404 an adapter not found), as
every /v1 route sends it (`openai_envelope`: `code` is OpenAI's string or null, not vLLM's number)."""

from __future__ import annotations

from aiohttp import web

from gaudi_runtime.router import openai_envelope
from gaudi_runtime.router.adapter_updates import UpdateError
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.request_models import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    parse_request,
)
from gaudi_runtime.router.state import get_state
from gaudi_runtime.router.validation import parse_json_body


def vllm_error(status: int, kind: str, message: str) -> web.Response:
    """OpenAI's envelope as every /v1 route sends it (`openai_envelope`), with vLLM's error kind as its type."""
    answer = openai_envelope.body(status, message)
    answer["error"]["type"] = kind
    return web.json_response(answer, status=status)


def _body(raw: bytes, model):
    """The body as `model`; UpdateError (400) naming the field otherwise."""
    try:
        return parse_request(model, parse_json_body(raw))
    except ValidationError as e:
        raise UpdateError(400, "BadRequestError", str(e)) from None


async def _answer(request: web.Request, run) -> web.Response:
    updates = get_state(request).adapter_updates
    if updates is None:  # an app built without the shards' updater (a stand-in engine)
        return vllm_error(503, "ServiceUnavailableError", "LoRA adapters cannot be loaded on this server")
    try:
        return web.Response(text=await run(updates))
    except UpdateError as e:
        return vllm_error(e.status, e.kind, str(e))


async def handle_load(request: web.Request) -> web.Response:
    async def run(updates):
        body = _body(await request.read(), LoadLoraAdapterRequest)
        return await updates.load(body.lora_name or "", body.lora_path or "", body.load_inplace)

    return await _answer(request, run)


async def handle_unload(request: web.Request) -> web.Response:
    async def run(updates):
        body = _body(await request.read(), UnloadLoraAdapterRequest)
        return await updates.unload(body.lora_name or "")

    return await _answer(request, run)
