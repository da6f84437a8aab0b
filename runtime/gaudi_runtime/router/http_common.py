"""What TGI's and OpenAI's handlers share: reading a body, the request's metrics around validation
and generation, the model's name, log-probabilities and JSON in responses.

Both API modules import this one and never each other, so either can change its shapes alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.inference import Generation, RequestRecorder, check_health, collect_all
from gaudi_runtime.router.json_text import dumps
from gaudi_runtime.router.state import AppState, get_state
from gaudi_runtime.router.types import ValidRequest
from gaudi_runtime.router.validation import parse_json_body


def recorder(request: web.Request) -> RequestRecorder:
    """The metrics (and trace) of one HTTP request, counted from now."""
    state = get_state(request)
    return RequestRecorder(state.metrics, tracer=state.tracer)


async def read_body(request: web.Request, rec: RequestRecorder | None = None) -> dict:
    """The request's JSON object; a body that is not one is a recorded validation failure."""
    try:
        return parse_json_body(await request.read())
    except ValidationError as e:
        if rec is not None:
            rec.failure(e)
        raise


@contextmanager
def recorded(rec: RequestRecorder) -> Iterator[None]:
    """Whatever ends the block early is recorded on the request's metrics, then re-raised: an error
    by its type (validation, overloaded, ...), a cancellation (the client went away) as such."""
    try:
        yield
    except Exception as e:
        rec.failure(e)
        raise
    except BaseException:
        rec.cancelled()
        raise


async def admit(state: AppState, rec: RequestRecorder, requests: list[ValidRequest]) -> None:
    """Validated requests about to be generated, if the engine can serve now and their grammars
    compile (the compilation counts as validation time)."""
    check_health(state)
    await state.engine.check_grammars(requests)
    rec.validated(requests)


async def generate_all(state: AppState, requests: list[ValidRequest], rec: RequestRecorder) -> list[Generation]:
    """Every token of every request (for a non-streaming response); a failure is recorded."""
    with recorded(rec):
        return await collect_all(state, requests, rec)


def model_name(state: AppState) -> str:
    """The name clients see: `--model-name` when given, else the model id."""
    return state.config.model.model_name or state.config.model.model_id


def finite_logprob(v: float | None) -> float | None:
    """JSON has no NaN or infinity: such a log-probability is sent as null."""
    return None if v is None or math.isnan(v) or math.isinf(v) else v


def json_response(body, *, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response with text as UTF-8 (not \\u escapes)."""
    return web.json_response(body, headers=headers, dumps=dumps)
