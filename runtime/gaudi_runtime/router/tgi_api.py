"""TGI's routes: /generate, /generate_stream, /, /tokenize, /info, /health, /ping, /metrics.
Response shapes follow TGI so its clients work unchanged."""

from __future__ import annotations

import os
import time
from pathlib import Path

from aiohttp import web

import gaudi_runtime
from gaudi_runtime import progress
from gaudi_runtime.router import adapters, json_text, sse
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
from gaudi_runtime.router.inference import Generation, RequestRecorder, events
from gaudi_runtime.router.metrics import CONTENT_TYPE
from gaudi_runtime.router.request_models import GenerateRequest, TokenizeRequest, parse_request
from gaudi_runtime.router.state import AppState, get_state
from gaudi_runtime.router.types import GenerationEnd, StreamEvent, Token, ValidRequest
from gaudi_runtime.router.validation import (
    GenerateJob,
    best_of_requests,
    parse_generate,
    tokenize_input,
    validate_generate,
)
from gaudi_runtime.start_http import liveness

# The router's start: the stall rule counts from here when no process has reported a step yet.
ROUTER_STARTED_AT = time.monotonic()


def token_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": finite_logprob(t.logprob), "special": t.special}


def prefill_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": finite_logprob(t.logprob)}


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
        "x-compute-type": state.config.device.device,
        "x-compute-time": f"{rec.elapsed:.6f}",
        "x-total-time": f"{rec.elapsed * 1000:.0f}",
        "x-validation-time": f"{validation * 1000:.0f}",
        "x-queue-time": f"{end.queue_time * 1000:.0f}",
        "x-inference-time": f"{end.inference_time * 1000:.0f}",
        "x-time-per-token": f"{per_token * 1000:.0f}",
        "x-prompt-tokens": str(input_length),
        "x-generated-tokens": str(end.generated_tokens),
        "x-model-id": model_name(state),
    }
    if end.seed is not None:
        h["x-seed"] = str(end.seed)
    return h


# --- generate --------------------------------------------------------------------------

async def validated_job(state: AppState, body: dict | GenerateRequest, *, stream: bool) -> GenerateJob:
    """A TGI body, its images fetched for a vision model, validated."""
    req = body if isinstance(body, GenerateRequest) else parse_generate(body)
    images = await prompt_images(state, req.inputs)
    adapter = adapters.tgi_adapter(state.adapters, req.parameters.adapter_id)
    return validate_generate(req, state.config.limits, state.config.structured_output, state.tokenizer,
                             stream=stream, images=images, thinking=state.thinking, adapter=adapter)


async def run_generate(request: web.Request, body: dict | GenerateRequest, rec: RequestRecorder, *,
                       as_list: bool = False) -> web.Response:
    state = get_state(request)
    with recorded(rec):
        job = await validated_job(state, body, stream=False)
        await admit(state, rec, [job.request])
    gens = await generate_all(state, best_of_requests(job), rec)
    resp, best = generate_response(gens)
    rec.success_pending()
    headers = timing_headers(state, rec, best.end, len(best.request.input_ids))
    return json_response([resp] if as_list else resp, headers=headers)


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


def token_text(t: Token) -> str:
    """`token_json(t)` as JSON text."""
    return (f'{{"id": {t.id}, "text": {json_text.string(t.text)}, "logprob": {json_text.logprob(t.logprob)}, '
            f'"special": {"true" if t.special else "false"}}}')


def stream_event_text(index: int, ev: StreamEvent, request: ValidRequest) -> str:
    """`stream_event_json` as JSON text; every event but the last (the one with `details`) from a
    template, only its token serialized."""
    if ev.end is not None:
        return json_text.dumps(stream_event_json(index, ev, request))
    tops = ", ".join(token_text(t) for t in ev.top_tokens)
    return (f'{{"index": {index}, "token": {token_text(ev.token)}, "top_tokens": [{tops}], '
            '"generated_text": null, "details": null}')


async def run_generate_stream(request: web.Request, body: dict | GenerateRequest,
                              rec: RequestRecorder) -> web.StreamResponse:
    state = get_state(request)
    with recorded(rec):
        job = await validated_job(state, body, stream=True)
        await admit(state, rec, [job.request])
    return await stream_tgi(request, state, job.request, rec)


async def stream_tgi(request: web.Request, state: AppState, vreq: ValidRequest,
                     rec: RequestRecorder) -> web.StreamResponse:
    index = 0

    def render(group: list[StreamEvent]):
        nonlocal index
        for ev in group:
            index += 1
            yield stream_event_text(index, ev, vreq)

    return await sse.drive(request, events(state, vreq, rec), rec, render,
                           headers={"x-model-id": model_name(state)})


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
    with recorded(rec):
        req = parse_generate(body)
    if req.stream:
        return await run_generate_stream(request, req, rec)
    return await run_generate(request, req, rec, as_list=True)


# --- tokenize, info, health, ping, metrics ------------------------------------------------

async def handle_tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    req = parse_request(TokenizeRequest, await read_body(request))
    tokenize_input(req.inputs, state.tokenizer)  # same checks as /generate
    add_special = req.parameters.add_special_tokens if req.add_special_tokens is None else req.add_special_tokens
    out = []
    for tid, start, stop in state.tokenizer.encode_with_offsets(req.inputs, add_special_tokens=add_special):
        text = req.inputs[start:stop] if stop > start else state.tokenizer.decode([tid])
        out.append({"id": tid, "text": text, "start": start, "stop": stop})
    return json_response(out)


def _model_sha(model_id: str) -> str | None:
    """The snapshot hash when the model directory is a hub cache snapshot."""
    p = Path(model_id)
    if p.parent.name == "snapshots" and len(p.name) == 40:
        return p.name
    return None


def info_body(state: AppState) -> dict:
    c = state.config
    body = {
        "model_id": model_name(state),
        "model_sha": c.model.revision if c.model.revision and len(c.model.revision) == 40
        else _model_sha(c.model.model_id),
        "model_dtype": c.model.dtype,
        "model_device_type": c.device.device,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": c.limits.max_concurrent_requests,
        "max_best_of": c.limits.max_best_of,
        "max_stop_sequences": c.limits.max_stop_sequences,
        "max_input_tokens": c.limits.max_input_tokens,
        "max_input_length": c.limits.max_input_tokens,
        "max_total_tokens": c.limits.max_total_tokens,
        "max_top_n_tokens": c.limits.max_top_n_tokens,
        "validation_workers": 1,
        "max_client_batch_size": c.limits.max_client_batch_size,
        "waiting_served_ratio": c.scheduling.waiting_served_ratio,
        "max_batch_total_tokens": c.scheduling.max_batch_total_tokens,
        "max_waiting_tokens": c.scheduling.max_waiting_tokens,
        "max_batch_size": c.scheduling.max_batch_size,
        "prefix_caching": c.scheduling.prefix_caching,
        "lora_adapters": [a.name for a in state.adapters.served()],
        "max_loras": c.adapters.max_loras,
        "max_cpu_loras": c.adapters.max_cpu_loras,
        "runtime_lora_updating": c.adapters.allow_runtime_lora_updating,
        "max_lora_rank": c.adapters.max_lora_rank,
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


async def handle_livez(request: web.Request) -> web.Response:
    """Liveness: 200 while serving or while the start makes progress; 503 once it stalled (progress.py)
    or the shards failed. Outside a launched pod (no progress directory) only a failure fails it."""
    state = get_state(request)
    ready, health = state.engine.health()
    if ready:
        return web.json_response({"status": "ok"})
    if health.get("status") == "failed":
        return web.json_response({"status": "failed", "error": health.get("error", ""), "error_type": "unhealthy"},
                                 status=503)
    directory = os.environ.get(progress.PROGRESS_DIR_ENV)
    if not directory:
        return web.json_response({"status": "ok"})
    code, body = liveness(directory, ROUTER_STARTED_AT, state.config.server.warmup_stall_seconds)
    return web.json_response(body, status=code)


async def handle_metrics(request: web.Request) -> web.Response:
    state = get_state(request)
    try:
        state.metrics.tgi_queue_size.set(state.engine.queue_size())
    except Exception:  # the engine's own gauge stays authoritative
        pass
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
