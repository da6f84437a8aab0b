"""Server-sent events: `data: <json>\\n\\n` frames on a streaming response.

The events ready together (the tokens one decode call gives a request) go out in one write: each
write costs a system call and a drain check, more than the bytes it carries.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from gaudi_runtime.router.json_text import dumps

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    return resp


def frame(payload: dict | str) -> str:
    """One event: a payload dict, or JSON text already rendered (as `json.dumps` would render it)."""
    return f"data: {payload if isinstance(payload, str) else dumps(payload)}\n\n"


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionError, RuntimeError) as e:  # aiohttp: ClientConnectionResetError, closed transport
        raise ClientGone(str(e)) from e


async def send(resp: web.StreamResponse, payload: dict | str) -> None:
    await _write(resp, frame(payload).encode())


async def send_all(resp: web.StreamResponse, payloads: Iterable[dict | str]) -> None:
    """Several events in one write (one system call, one drain check). Should rendering fail part-way
    through `payloads`, the events rendered before it are still sent, as they would be one by one."""
    frames: list[str] = []
    try:
        for p in payloads:
            frames.append(frame(p))
    finally:
        if frames:
            await _write(resp, "".join(frames).encode())


async def drive(request: web.Request, items, rec, render, finish=None,
                headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Stream `items` (an async iterator, closed on every exit) as SSE.

    `render(item)` gives the payloads for one item (the events ready together: one write);
    `finish()` those sent after the last (e.g. usage and "[DONE]"). The first item is awaited before the response
    starts, so an engine that refuses the request (overloaded, failed) still gets its
    own status code. A failure after that becomes an error event in the route's shape (`openai_errors`).
    `rec` is the RequestRecorder: told of success, failure or a client gone.
    """
    from contextlib import aclosing

    from gaudi_runtime.router.openai_errors import error_body_for, error_response_for

    async with aclosing(items):
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            rec.failure(e)
            return error_response_for(request.path, e)
        except BaseException:
            rec.cancelled()
            raise
        resp = await open_stream(request, headers)
        try:
            if first is not None:
                await send_all(resp, render(first))
                async for item in items:
                    await send_all(resp, render(item))
            await send_all(resp, finish() if finish else ())
            rec.success_pending()
        except ClientGone:
            rec.cancelled()
            return resp
        except Exception as e:
            rec.failure(e)
            try:
                await send(resp, error_body_for(request.path, e))
            except ClientGone:
                return resp
        except BaseException:
            rec.cancelled()
            raise
    try:
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return resp
