"""A stand-in for the Hugging Face hub on 127.0.0.1, for `huggingface_hub` clients pointed at it with HF_ENDPOINT.

It answers the routes huggingface_hub 2.x calls to resolve a revision, list a repository and fetch its
files (`HfApi.resolve_revision` / `model_info`, `list_repo_tree`, `get_hf_file_metadata`,
`hf_hub_download`, `snapshot_download`):

    GET       /api/models/{org}/{name}[/revision/{rev}]   model info: sha, siblings with size, blobId, lfs
    GET       /api/models/{org}/{name}/tree/{rev}[/{dir}]  listing (?recursive=true|false), one page
    HEAD, GET /{org}/{name}/resolve/{rev}/{path}          the file: ETag, X-Repo-Commit, Content-Length,
                                                           Accept-Ranges; a Range request gets 206

Errors carry the hub's X-Error-Code headers (RepoNotFound, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its typed errors. With `token` set, a request without that bearer token
gets the hub's 401 for bad credentials. Faults for tests, each used once: `fail_once(file, after,
"hang")` stalls the file after `after` bytes until `release()` (a client killed mid-file), "drop" closes
the connection there (a network cut); `corrupt_once(file)` serves the file with its first bytes
scrambled. Every request is recorded in `requests` (method, path, range, bytes of body sent).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from dataclasses import dataclass, field

from aiohttp import web

CHUNK = 1 << 20
RECORD = web.RequestKey("record", dict)


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class StandInRepo:
    files: dict[str, bytes]
    branch: str = "main"

    @property
    def commit(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith(".safetensors")

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else git_blob_oid(data)

    def entry(self, name: str) -> dict:
        data = self.files[name]
        out = {"type": "file", "path": name, "size": len(data), "oid": git_blob_oid(data)}
        if self.is_lfs(name):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


@dataclass
class Fault:
    after: int
    mode: str  # "hang" | "drop"


@dataclass
class HubStandIn:
    repos: dict[str, StandInRepo]
    token: str | None = None
    requests: list[dict] = field(default_factory=list)
    _faults: dict[str, Fault] = field(default_factory=dict)
    _corrupt: set[str] = field(default_factory=set)

    # ---- set-up -----------------------------------------------------------------------------

    def fail_once(self, file: str, after: int, mode: str = "hang") -> None:
        self._faults[file] = Fault(after, mode)

    def corrupt_once(self, file: str) -> None:
        self._corrupt.add(file)

    def start(self) -> HubStandIn:
        self._released = asyncio.Event()
        self._thread = _LoopThread(self._app())
        self._thread.start()
        self._loop = self._thread.loop
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._thread.port}"

    def release(self) -> None:
        """Let hung transfers end (their connection is closed)."""
        self._loop.call_soon_threadsafe(self._released.set)

    def stop(self) -> None:
        self.release()
        self._thread.stop()

    def bytes_sent(self, path_suffix: str) -> int:
        return sum(r["sent"] for r in self.requests if r["method"] == "GET" and r["path"].endswith(path_suffix))

    # ---- routes -----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._record_and_authorize])
        app.router.add_get(r"/api/models/{org}/{name}", self._model_info)
        app.router.add_get(r"/api/models/{org}/{name}/revision/{rev}", self._model_info)
        app.router.add_get(r"/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_get(r"/api/models/{org}/{name}/tree/{rev}/{dir:.+}", self._tree)
        app.router.add_get(r"/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)  # HEAD too
        return app

    @web.middleware
    async def _record_and_authorize(self, request: web.Request, handler):
        record = {"method": request.method, "path": request.path, "range": request.headers.get("Range"),
                  "authorization": request.headers.get("Authorization"), "sent": 0}
        self.requests.append(record)
        request[RECORD] = record
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            message = "Invalid credentials in Authorization header"
            return web.json_response({"error": message}, status=401, headers={"X-Error-Message": message})
        return await handler(request)

    def _repo(self, request: web.Request) -> tuple[StandInRepo, str]:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        rev = request.match_info.get("rev", repo.branch)
        if rev not in (repo.branch, repo.commit):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="Invalid rev id")
        return repo, repo_id

    async def _model_info(self, request: web.Request) -> web.Response:
        repo, repo_id = self._repo(request)
        siblings = [{"rfilename": n, "size": e["size"], "blobId": e["oid"], **({"lfs": {
            "sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}} if "lfs" in e else {})}
            for n in sorted(repo.files) for e in [repo.entry(n)]]
        return web.json_response({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                  "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        repo, _ = self._repo(request)
        prefix = request.match_info.get("dir", "").strip("/")
        prefix = prefix + "/" if prefix else ""
        recursive = request.query.get("recursive", "false").lower() == "true"
        out, dirs = [], set()
        for name in sorted(repo.files):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/", 1)[0])
                continue
            out.append(repo.entry(name))
        out += [{"type": "directory", "path": d, "size": 0, "oid": hashlib.sha1(d.encode()).hexdigest()}
                for d in sorted(dirs)]
        return web.json_response(out)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo, _ = self._repo(request)
        path = request.match_info["path"]
        if path not in repo.files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit},
                                   text="Entry not found")
        data = repo.files[path]
        start = _range_start(request.headers.get("Range"))
        headers = {"ETag": f'"{repo.etag(path)}"', "X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        status = 200
        if start:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(data) - start)
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        if path in self._corrupt:
            self._corrupt.discard(path)
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        return await self._stream(request, web.StreamResponse(status=status, headers=headers), data, start,
                                  self._faults.pop(path, None))

    async def _stream(self, request, response, data: bytes, start: int, fault: Fault | None):
        await response.prepare(request)
        end = len(data) if fault is None else max(start, min(fault.after, len(data)))
        for i in range(start, end, CHUNK):
            chunk = data[i:min(i + CHUNK, end)]
            await response.write(chunk)
            request[RECORD]["sent"] += len(chunk)
        if fault is not None:
            if fault.mode == "hang":
                await self._released.wait()
            request.transport.close()  # the body ends short of its Content-Length
            return response
        await response.write_eof()
        return response


def _range_start(header: str | None) -> int:
    m = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(m.group(1)) if m else 0


class _LoopThread:
    """An aiohttp app on a free loopback port, served from its own thread and event loop."""

    def __init__(self, app: web.Application):
        self.app = app
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hub-standin", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("hub stand-in did not start")

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
