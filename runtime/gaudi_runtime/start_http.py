"""The launcher's HTTP port before the router has it: bound first, answered while the model downloads,
then handed to the router process, so that the kubelet's probes find an answer from the start.

The launcher binds `--hostname:--port` before anything else and serves the probes on it from a thread
while it fetches the model (which may take an hour): `/livez` by the stall rule of progress.py, `/health`
and everything else 503 with what it is doing, `/ping` 200. Before it starts the router it stops
answering, without closing the socket, and passes the socket to the router (LISTEN_FD_ENV): a probe
arriving in between waits in the socket's backlog and the router answers it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gaudi_runtime import progress
from gaudi_runtime.router import openai_envelope

LISTEN_FD_ENV = "GAUDI_SERVE_LISTEN_FD"

__all__ = ["LISTEN_FD_ENV", "StartServer", "bind", "liveness"]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket the launcher, then the router, serve on (SO_REUSEADDR, as aiohttp sets it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.set_inheritable(True)
    return sock


def liveness(progress_dir: str | None, started_at: float, window_s: float,
             now: Callable[[], float] = time.monotonic) -> tuple[int, dict]:
    """/livez while not serving: 200 with the last step, or 503 with why the start counts as stuck."""
    last = progress.latest(progress_dir)
    why = progress.stall(last, started_at, now(), window_s)
    if why:
        return 503, {"status": "stalled", "error": why, "error_type": "unhealthy"}
    body: dict = {"status": "ok"}
    if last is not None:
        body["progress"] = {"phase": last.phase, "done": last.done, "total": last.total,
                            "idle_seconds": round(now() - last.at, 1)}
    return 200, body


def refusal(path: str, state: dict) -> dict:
    """The 503 body of a route while the start goes on, in the shape the router gives it later: OpenAI's
    envelope on /v1 (which has no room for the progress: /health has it), TGI's with the state elsewhere."""
    message = f"the server cannot serve requests yet ({state['status']})"
    if openai_envelope.applies(path):
        return openai_envelope.body(503, message)
    return {"error": message, "error_type": "unhealthy", **state}


class StartServer:
    """Answers the probes on `sock` from a thread until `hand_over`."""

    def __init__(self, sock: socket.socket, status: Callable[[], dict], live: Callable[[], tuple[int, dict]]):
        self.sock = sock
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer._answer(self)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line
                pass

        self.server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.server.socket.close()  # the one it made: it serves ours
        self.server.socket = sock
        self.server.daemon_threads = True
        self.status, self.live = status, live
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="start-http", daemon=True)

    def start(self) -> StartServer:
        self.thread.start()
        return self

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/ping":
            code, body = 200, {"status": "ok"}
        elif path == "/livez":
            code, body = self.live()
        elif path == "/health":
            code, body = 503, self.status()
        else:
            code, body = 503, refusal(path, self.status())
        data = json.dumps(body).encode()
        request.send_response(code)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def hand_over(self) -> int:
        """Stop answering; the socket stays open for the router. Returns its file descriptor."""
        self.server.shutdown()
        self.thread.join()
        return self.sock.fileno()
