"""The kubelet's log endpoint for the simulated nodes, which kwok leaves to the tests.

`kubectl logs` and the operator's read of a pod's log (`pods/log`) go to the API server, which
asks the kubelet of the pod's node: HTTPS at the node's InternalIP and its `daemonEndpoints`
port, `GET /containerLogs/<namespace>/<pod>/<container>?tailLines=&limitBytes=`. This serves that
on every node IP (all in 127.0.0.0/8) from the output files of the real processes that play
containers: a test registers a container's file, the answer is its tail. An unregistered
container's log is a 404, as a kubelet answers for a container it does not run.
"""

from __future__ import annotations

import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class KubeletLogs:
    def __init__(self, port: int, cert: Path, key: Path) -> None:
        self.port = port
        self.files: dict[tuple[str, str, str], Path] = {}
        self.requests: list[str] = []
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(cert), str(key))
        self._servers: list[ThreadingHTTPServer] = []

    def register(self, namespace: str, pod: str, container: str, path: Path) -> None:
        self.files[(namespace, pod, container)] = path

    def serve(self, ip: str) -> None:
        """Answer on `ip` (a node's InternalIP) as well."""
        logs = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                logs.requests.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                path = logs.files.get(tuple(parts[1:4])) if len(parts) == 4 and parts[0] == "containerLogs" else None
                if path is None or not path.exists():
                    self.send_error(404, "container not found")
                    return
                self._send(logs.tail(path, urllib.parse.parse_qs(url.query)))

            def _send(self, data: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer((ip, self.port), Handler)
        server.socket = self._context.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=f"kubelet-logs-{ip}", daemon=True).start()
        self._servers.append(server)

    @staticmethod
    def tail(path: Path, query: dict[str, list[str]]) -> bytes:
        data = path.read_bytes()
        if "tailLines" in query:
            n = int(query["tailLines"][0])
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-n:]) if n else b""
        if "limitBytes" in query:
            data = data[:int(query["limitBytes"][0])]
        return data

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
