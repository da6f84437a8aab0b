"""Server-sent events: `data: <json>\\n\\n` frames on a streaming response."""

from __future__ import annotations

import json

from aiohttp import web

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


async def send(resp: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    try:
        await resp.write(f"data: {data}\n\n".encode())
    except (ConnectionError, RuntimeError) as e:  # aiohttp: ClientConnectionResetError, closed transport
        raise ClientGone(str(e)) from e


async def drive(request: web.Request, items, rec, render, finish=None,
                headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Stream `items` (an async iterator, closed on every exit) as SSE.

    `render(item)` gives the payloads for one item; `finish()` those sent after the
    last (e.g. usage and "[DONE]"). The first item is awaited before the response
    starts, so an engine that refuses the request (overloaded, failed) still gets its
    own status code. A failure after that becomes an `{"error", "error_type"}` event.
    `rec` is the RequestRecorder: told of success, failure or a client gone.
    """
    from contextlib import aclosing

    from gaudi_runtime.router.errors import error_body, error_response

    async with aclosing(items):
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            rec.failure(e)
            return error_response(e)
        except BaseException:
            rec.cancelled()
            raise
        resp = await open_stream(request, headers)
        try:
            if first is not None:
                for p in render(first):
                    await send(resp, p)
                async for item in items:
                    for p in render(item):
                        await send(resp, p)
            for p in finish() if finish else ():
                await send(resp, p)
            rec.success_pending()
        except ClientGone:
            rec.cancelled()
            return resp
        except Exception as e:
            rec.failure(e)
            try:
                await send(resp, error_body(e))
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
