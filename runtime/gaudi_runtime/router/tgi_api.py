"""TGI's routes: /generate, /generate_stream, / and /invocations, /tokenize, /info,
/health, /ping, /metrics. Response shapes follow TGI so its clients work unchanged."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from aiohttp import web

import gaudi_runtime
from gaudi_runtime.router import sse
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.images import prompt_images
from gaudi_runtime.router.inference import (
    Generation,
    RequestRecorder,
    check_health,
    collect_all,
    events,
)
from gaudi_runtime.router.metrics import CONTENT_TYPE
from gaudi_runtime.router.state import AppState, get_state
from gaudi_runtime.router.types import GenerationEnd, StreamEvent, Token, ValidRequest
from gaudi_runtime.router.validation import (
    best_of_requests,
    parse_json_body,
    tokenize_input,
    validate_generate,
)


def _logprob(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) or math.isinf(v) else v


def token_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": _logprob(t.logprob), "special": t.special}


def prefill_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": _logprob(t.logprob)}


def full_text(request: ValidRequest, text: str) -> str:
    return request.inputs + text if request.return_full_text else text


def _sequence_details(g: Generation) -> dict:
    end = g.end
    assert end is not None
    d = {
        "finish_reason": end.finish_reason.value,
        "generated_tokens": end.generated_tokens,
        "seed": end.seed,
        "prefill": [prefill_json(t) for t in end.prefill],
        "tokens": [token_json(t) for t in g.tokens],
    }
    if g.request.top_n_tokens:
        d["top_tokens"] = [[token_json(t) for t in tops] for tops in g.top_tokens]
    return d


def generate_response(gens: list[Generation]) -> tuple[dict, Generation]:
    """TGI's GenerateResponse for the best of `gens` (highest sum of logprobs)."""
    best = max(gens, key=lambda g: g.logprob_sum) if len(gens) > 1 else gens[0]
    assert best.end is not None
    body: dict = {"generated_text": full_text(best.request, best.end.generated_text)}
    if best.request.details:
        details = _sequence_details(best)
        if len(gens) > 1:
            details["best_of_sequences"] = [
                {"generated_text": full_text(g.request, g.end.generated_text), **_sequence_details(g)}
                for g in gens if g is not best
            ]
        body["details"] = details
    return body, best


def timing_headers(state: AppState, rec: RequestRecorder, end: GenerationEnd, input_length: int) -> dict:
    validation = (rec.validated_at or rec.start) - rec.start
    per_token = end.inference_time / end.generated_tokens if end.generated_tokens else 0.0
    h = {
        "x-compute-type": state.config.device,
        "x-compute-time": f"{rec.elapsed:.6f}",
        "x-total-time": f"{rec.elapsed * 1000:.0f}",
        "x-validation-time": f"{validation * 1000:.0f}",
        "x-queue-time": f"{end.queue_time * 1000:.0f}",
        "x-inference-time": f"{end.inference_time * 1000:.0f}",
        "x-time-per-token": f"{per_token * 1000:.0f}",
        "x-prompt-tokens": str(input_length),
        "x-generated-tokens": str(end.generated_tokens),
        "x-model-id": state.config.model_name or state.config.model_id,
    }
    if end.seed is not None:
        h["x-seed"] = str(end.seed)
    return h


async def read_body(request: web.Request, rec: RequestRecorder | None = None) -> dict:
    try:
        return parse_json_body(await request.read())
    except ValidationError as e:
        if rec is not None:
            rec.failure(e)
        raise


# --- generate --------------------------------------------------------------------------

async def run_generate(request: web.Request, body: dict, rec: RequestRecorder, *,
                       as_list: bool = False) -> web.Response:
    state = get_state(request)
    try:
        images = await prompt_images(state, body.get("inputs"))
        job = validate_generate(body, state.config, state.tokenizer, stream=False, images=images)
        reqs = best_of_requests(job)
        rec.validated([job.request])
        check_health(state)
        gens = await collect_all(state, reqs, rec)
    except Exception as e:
        rec.failure(e)
        raise
    except BaseException:
        rec.cancelled()
        raise
    resp, best = generate_response(gens)
    rec.success_pending()
    headers = timing_headers(state, rec, best.end, len(best.request.input_ids))
    return web.json_response([resp] if as_list else resp, headers=headers,
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))


def stream_event_json(index: int, ev: StreamEvent, request: ValidRequest) -> dict:
    end = ev.end
    return {
        "index": index,
        "token": token_json(ev.token),
        "top_tokens": [token_json(t) for t in ev.top_tokens],
        "generated_text": None if end is None else full_text(request, end.generated_text),
        "details": None if end is None else {
            "finish_reason": end.finish_reason.value,
            "generated_tokens": end.generated_tokens,
            "seed": end.seed,
            "input_length": len(request.input_ids),
        },
    }


async def run_generate_stream(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    try:
        images = await prompt_images(state, body.get("inputs"))
        job = validate_generate(body, state.config, state.tokenizer, stream=True, images=images)
        rec.validated([job.request])
        check_health(state)
    except Exception as e:
        rec.failure(e)
        raise
    return await stream_tgi(request, state, job.request, rec)


async def stream_tgi(request: web.Request, state: AppState, vreq: ValidRequest,
                     rec: RequestRecorder) -> web.StreamResponse:
    index = 0

    def render(ev: StreamEvent) -> list[dict]:
        nonlocal index
        index += 1
        return [stream_event_json(index, ev, vreq)]

    return await sse.drive(request, events(state, vreq, rec), rec, render,
                           headers={"x-model-id": state.config.model_name or state.config.model_id})


def recorder(request: web.Request) -> RequestRecorder:
    state = get_state(request)
    return RequestRecorder(state.metrics, tracer=state.tracer)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_generate(request, await read_body(request, rec), rec)


async def handle_generate_stream(request: web.Request) -> web.StreamResponse:
    rec = recorder(request)
    return await run_generate_stream(request, await read_body(request, rec), rec)


async def handle_compat(request: web.Request) -> web.StreamResponse:
    """`/`: stream or not according to the body's `stream` field (TGI's compat route)."""
    rec = recorder(request)
    return await compat_generate(request, await read_body(request, rec), rec)


async def compat_generate(request: web.Request, body: dict, rec: RequestRecorder) -> web.StreamResponse:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        e = ValidationError("Failed to deserialize the JSON body: `stream`: expected a boolean")
        rec.failure(e)
        raise e
    if stream:
        return await run_generate_stream(request, body, rec)
    return await run_generate(request, body, rec, as_list=True)


async def handle_invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's route: a chat body, a completions body, or a TGI body."""
    from gaudi_runtime.router import openai_api

    rec = recorder(request)
    body = await read_body(request, rec)
    if "messages" in body:
        return await openai_api.run_chat(request, body, rec)
    if "prompt" in body and "inputs" not in body:
        return await openai_api.run_completions(request, body, rec)
    return await compat_generate(request, body, rec)


# --- tokenize, info, health, ping, metrics ------------------------------------------------

async def handle_tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    body = await read_body(request)
    if "inputs" not in body:
        raise ValidationError("Failed to deserialize the JSON body: missing field `inputs`")
    inputs = body["inputs"]
    tokenize_input(inputs, state.tokenizer)  # same checks as /generate
    params = body.get("parameters") or {}
    add_special = body.get("add_special_tokens", params.get("add_special_tokens", True)) is not False
    out = []
    for tid, start, stop in state.tokenizer.encode_with_offsets(inputs, add_special_tokens=add_special):
        text = inputs[start:stop] if stop > start else state.tokenizer.decode([tid])
        out.append({"id": tid, "text": text, "start": start, "stop": stop})
    return web.json_response(out, dumps=lambda o: json.dumps(o, ensure_ascii=False))


def _model_sha(model_id: str) -> str | None:
    """The snapshot hash when the model directory is a hub cache snapshot."""
    p = Path(model_id)
    if p.parent.name == "snapshots" and len(p.name) == 40:
        return p.name
    return None


def info_body(state: AppState) -> dict:
    c = state.config
    body = {
        "model_id": c.model_name or c.model_id,
        "model_sha": c.revision if c.revision and len(c.revision) == 40 else _model_sha(c.model_id),
        "model_dtype": c.dtype,
        "model_device_type": c.device,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": c.max_concurrent_requests,
        "max_best_of": c.max_best_of,
        "max_stop_sequences": c.max_stop_sequences,
        "max_input_tokens": c.max_input_tokens,
        "max_input_length": c.max_input_tokens,
        "max_total_tokens": c.max_total_tokens,
        "max_top_n_tokens": c.max_top_n_tokens,
        "validation_workers": 1,
        "max_client_batch_size": c.max_client_batch_size,
        "waiting_served_ratio": c.waiting_served_ratio,
        "max_batch_total_tokens": c.max_batch_total_tokens,
        "max_waiting_tokens": c.max_waiting_tokens,
        "max_batch_size": c.max_batch_size,
        "router": "gaudi-serve-router",
        "version": gaudi_runtime.__version__,
        "sha": os.environ.get("GIT_SHA") or None,
        "docker_label": os.environ.get("DOCKER_LABEL") or None,
    }
    body.update(state.engine.info() or {})
    return body


async def handle_info(request: web.Request) -> web.Response:
    return web.json_response(info_body(get_state(request)))


async def handle_health(request: web.Request) -> web.Response:
    ok, body = get_state(request).engine.health()
    return web.json_response(body, status=200 if ok else 503)


async def handle_ping(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_metrics(request: web.Request) -> web.Response:
    state = get_state(request)
    try:
        state.metrics.tgi_queue_size.set(state.engine.queue_size())
    except Exception:  # the engine's own gauge stays authoritative
        pass
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
