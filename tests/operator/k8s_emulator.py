"""A small stateful Kubernetes API-server emulator on 127.0.0.1, for the operator's fast suite.

What it does, as the real API server does it:
* discovery (/version, /api, /apis, group versions with subresources);
* create, get, list (label selectors =, !=, existence), delete (with finalizers, and a
  resourceVersion precondition), watch streams from a resourceVersion (with bookmarks);
* garbage collection by ownerReferences: a dependent goes with its last owner; while other
  owners remain, only the reference to the deleted one is removed; a dependent written with
  references to owners that are already gone is collected the same way (a client that read its
  owner before the owner's deletion may still create it);
* a merge patch carrying metadata.resourceVersion is refused (409) if the object changed since;
* pods/log, from text the tests set (`logs`), as a kubelet would serve it (tailLines);
* a global resourceVersion; metadata.generation bumped on changes outside metadata/status;
  a no-op write changes nothing and emits no event;
* the status subresource (main-resource writes ignore status, /status writes touch only status);
* patches: JSON merge patch, JSON patch (test/add/replace/remove), strategic merge (as merge),
  server-side apply (application/apply-patch+yaml, merged; creates when absent).
What it does not: controllers (no ReplicaSets, no scheduler, no kubelet): tests play them.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web


@dataclass(frozen=True)
class Res:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def gv(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = [
    Res("", "v1", "pods", "Pod", subresources=("status",)),
    Res("", "v1", "services", "Service", subresources=("status",)),
    Res("", "v1", "events", "Event"),
    Res("", "v1", "secrets", "Secret"),
    Res("", "v1", "configmaps", "ConfigMap"),
    Res("", "v1", "namespaces", "Namespace", namespaced=False, subresources=("status",)),
    Res("apps", "v1", "deployments", "Deployment", subresources=("status", "scale")),
    Res("apps", "v1", "replicasets", "ReplicaSet", subresources=("status", "scale")),
    Res("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", subresources=("status",)),
    Res("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Res("batch", "v1", "jobs", "Job", subresources=("status",)),
    Res("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
        namespaced=False, subresources=("status",)),
    Res("gaudiserve.io", "v1alpha1", "inferenceservices", "InferenceService",
        subresources=("status", "scale"), short=("gisvc",), categories=("gaudi",)),
]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _ptr(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _ptr(op["path"])
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1] if parts else None
        kind = op["op"]
        if kind == "test":
            cur = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if cur != op.get("value"):
                raise ApiError(422, "Invalid", f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported op {kind}")
    return doc


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _selector_match(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        term = term.strip()
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip().lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class Event:
    rv: int
    res: Res
    type: str
    obj: dict[str, Any]


@dataclass
class Emulator:
    host: str = "127.0.0.1"
    port: int = 0
    bookmark_seconds: float = 5.0
    objects: dict[tuple[Res, str, str], dict[str, Any]] = field(default_factory=dict)
    log: list[Event] = field(default_factory=list)
    requests: list[tuple[str, str, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, pod) -> its container's log

    def __post_init__(self) -> None:
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # ---- lifecycle ------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self._closing = True
        if self._changed:
            async with self._changed:
                self._changed.notify_all()
        if self._runner:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- storage --------------------------------------------------------

    def _res(self, group: str, version: str, plural: str) -> Res:
        for r in RESOURCES:
            if (r.group, r.version, r.plural) == (group, version, plural):
                return r
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {group}/{version}/{plural}")

    def res_of(self, api_version: str, kind: str) -> Res:
        group, _, version = api_version.rpartition("/")
        for r in RESOURCES:
            if (r.group, r.version, r.kind) == (group, version, kind):
                return r
        raise KeyError(kind)

    def _emit(self, res: Res, type_: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._last_rv = max(self._last_rv, rv)
        self.log.append(Event(rv, res, type_, copy.deepcopy(obj)))
        if self._changed is not None:
            cond = self._changed

            async def notify() -> None:
                async with cond:
                    cond.notify_all()
            asyncio.get_running_loop().create_task(notify())

    def _bump(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def create(self, res: Res, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        ns = ns if res.namespaced else ""
        if res.namespaced:
            meta["namespace"] = ns
        key = (res, ns, name)
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        obj["apiVersion"], obj["kind"] = res.gv, res.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if res.kind == "InferenceService":  # status is written through the subresource only
            obj.pop("status", None)
        self._bump(obj)
        self.objects[key] = obj
        self._emit(res, "ADDED", obj)
        self._collect_orphan(res, key)
        return obj

    def _write(self, res: Res, key: tuple[Res, str, str], new: dict[str, Any], sub: str | None) -> dict[str, Any]:
        old = self.objects[key]
        new = copy.deepcopy(new)
        # Identity and server-owned metadata cannot be changed by a write.
        for f in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation",
                  "deletionTimestamp"):
            if f in old["metadata"]:
                new.setdefault("metadata", {})[f] = old["metadata"][f]
            else:
                new.setdefault("metadata", {}).pop(f, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if sub == "status":
            new = {**old, "status": new.get("status")} if new.get("status") is not None else \
                {k: v for k, v in old.items() if k != "status"}
        elif "status" in res.subresources:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        if new == old:
            return old  # no-op: no new resourceVersion, no event
        spec_changed = {k: v for k, v in old.items() if k not in ("metadata", "status")} != \
            {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if spec_changed:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._bump(new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.objects.pop(key)
            self._emit(res, "DELETED", new)
            self._cascade(new["metadata"]["uid"])
            return new
        self.objects[key] = new
        self._emit(res, "MODIFIED", new)
        self._collect_orphan(res, key)
        return new

    def patch(self, res: Res, ns: str, name: str, patch: Any, content_type: str, sub: str | None = None,
              manager: str | None = None) -> dict[str, Any]:
        ns = ns if res.namespaced else ""
        key = (res, ns, name)
        if key not in self.objects:
            if content_type.startswith("application/apply-patch") and sub is None:
                if not manager:
                    raise ApiError(422, "Invalid", "fieldManager is required for apply patches")
                return self.create(res, ns, patch)
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        old = self.objects[key]
        wanted = ((patch or {}).get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
        if wanted and wanted != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": '
                                            "the object has been modified; please apply your changes to the latest version")
        if content_type.startswith("application/json-patch"):
            new = json_patch(old, patch)
        else:  # merge, strategic merge, apply: merged
            new = merge_patch(old, patch)
        return self._write(res, key, new, sub)

    def delete(self, res: Res, ns: str, name: str, resource_version: str | None = None) -> dict[str, Any]:
        ns = ns if res.namespaced else ""
        key = (res, ns, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        obj = self.objects[key]
        if resource_version and resource_version != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'{res.plural} "{name}": the ResourceVersion in the precondition '
                                            "does not match")
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                self._bump(obj)
                self.objects[key] = obj
                self._emit(res, "MODIFIED", obj)
            return obj
        self.objects.pop(key)
        obj = copy.deepcopy(obj)
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        self._cascade(obj["metadata"]["uid"])
        return obj

    def _cascade(self, uid: str) -> None:
        """Garbage collection: a dependent of a deleted owner goes with its last owner; while others
        remain, only the dangling reference is removed."""
        for (res, ns, name), obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(o.get("uid") == uid for o in refs) or (res, ns, name) not in self.objects:
                continue
            rest = [o for o in refs if o.get("uid") != uid]
            if rest:
                self._write(res, (res, ns, name), {**obj, "metadata": {**obj["metadata"], "ownerReferences": rest}},
                            None)
            else:
                self.delete(res, ns, name)

    def _collect_orphan(self, res: Res, key: tuple[Res, str, str]) -> None:
        """Garbage collection of a dependent whose owners (some or all) no longer exist."""
        refs = self.objects[key]["metadata"].get("ownerReferences") or []
        if not refs:
            return
        uids = {o["metadata"].get("uid") for o in self.objects.values()}
        for owner in [o for o in refs if o.get("uid") not in uids]:
            if key in self.objects:
                self._cascade(owner.get("uid"))

    def list(self, res: Res, ns: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (r, n, _), o in sorted(self.objects.items(), key=lambda kv: kv[0][1:])
                if r == res and (ns is None or n == ns)
                and _selector_match(o["metadata"].get("labels") or {}, selector)]

    # ---- HTTP -----------------------------------------------------------

    def _parse(self, path: str) -> tuple[str, str, list[str]]:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 2:
            return "", parts[1], parts[2:]
        if parts[:1] == ["apis"] and len(parts) >= 3:
            return parts[1], parts[2], parts[3:]
        raise ApiError(404, "NotFound", f"no such path {path}")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path, request.query_string,
                              request.headers.get("Content-Type", "")))
        try:
            return await self._dispatch(request)
        except ConnectionResetError:  # a watcher went away
            return web.Response(status=499)
        except ApiError as e:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "message": e.message, "reason": e.reason, "code": e.code}, status=e.code)
        except Exception as e:  # a bug in the emulator must fail the test, not hang it
            self.errors.append(f"{request.method} {request.path}: {e!r}")
            raise

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path, method, q = request.path.rstrip("/"), request.method, request.query
        if path == "/version":
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-emulator"})
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            groups: dict[str, list[str]] = {}
            for r in RESOURCES:
                if r.group and r.version not in groups.setdefault(r.group, []):
                    groups[r.group].append(r.version)
            return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                 "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
                for g, vs in groups.items()]})
        group, version, rest = self._parse(path)
        if not rest:
            rs = [r for r in RESOURCES if (r.group, r.version) == (group, version)]
            if not rs:
                raise ApiError(404, "NotFound", path)
            verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
            items = []
            for r in rs:
                items.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                              "kind": r.kind, "verbs": verbs, "shortNames": list(r.short),
                              "categories": list(r.categories)})
                items += [{"name": f"{r.plural}/{s}", "singularName": "", "namespaced": r.namespaced,
                           "kind": r.kind, "verbs": ["get", "patch", "update"]} for s in r.subresources]
            return web.json_response({"kind": "APIResourceList", "groupVersion": rs[0].gv, "resources": items})
        ns: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            ns, rest = rest[1], rest[2:]
        res = self._res(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if method == "GET" and res.kind == "Pod" and sub == "log":
            return self._log(ns or "", name or "", q)
        if method == "GET" and name is None:
            if q.get("watch") in ("true", "1"):
                return await self._watch(request, res, ns, q)
            items = self.list(res, ns, q.get("labelSelector"))
            return web.json_response({"kind": f"{res.kind}List", "apiVersion": res.gv,
                                      "metadata": {"resourceVersion": str(self._last_rv)}, "items": items})
        if method == "GET":
            obj = self.objects.get((res, ns or "", name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
            return web.json_response(obj)
        if method == "POST" and name is None:
            return web.json_response(self.create(res, ns or "", await request.json()), status=201)
        if method == "PATCH" and name:
            ctype = request.headers.get("Content-Type", "application/merge-patch+json")
            text = await request.text()
            body = yaml.safe_load(text) if "yaml" in ctype else json.loads(text)
            return web.json_response(self.patch(res, ns or "", name, body, ctype, sub, q.get("fieldManager")))
        if method == "PUT" and name:
            key = (res, ns or "" if res.namespaced else "", name)
            if key not in self.objects:
                raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
            return web.json_response(self._write(res, key, await request.json(), sub))
        if method == "DELETE" and name:
            body = await request.json() if request.can_read_body else {}
            version = ((body or {}).get("preconditions") or {}).get("resourceVersion")
            return web.json_response(self.delete(res, ns or "", name, version))
        raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def _log(self, ns: str, name: str, q: Any) -> web.Response:
        if (self._res("", "v1", "pods"), ns, name) not in self.objects:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        lines = self.logs.get((ns, name), "").splitlines(keepends=True)
        if q.get("tailLines"):
            lines = lines[-int(q["tailLines"]):] if int(q["tailLines"]) else []
        return web.Response(text="".join(lines), content_type="text/plain")

    async def _watch(self, request: web.Request, res: Res, ns: str | None, q: Any) -> web.StreamResponse:
        assert self._changed is not None
        since = int(q.get("resourceVersion") or 0) or None
        selector = q.get("labelSelector")
        timeout = float(q.get("timeoutSeconds") or 300)
        rsp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await rsp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if since is None:  # from now, after the current state
            for obj in self.list(res, ns, selector):
                await rsp.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            since = self._last_rv
        pos = 0
        last_bookmark = loop.time()
        while not self._closing and loop.time() < deadline:
            batch = []
            while pos < len(self.log):
                ev = self.log[pos]
                pos += 1
                if ev.rv > since and ev.res == res and (ns is None or ev.obj["metadata"].get("namespace") == ns) \
                        and _selector_match(ev.obj["metadata"].get("labels") or {}, selector):
                    batch.append(ev)
            for ev in batch:
                await rsp.write(json.dumps({"type": ev.type, "object": ev.obj}).encode() + b"\n")
            if loop.time() - last_bookmark > self.bookmark_seconds:
                last_bookmark = loop.time()
                await rsp.write(json.dumps({"type": "BOOKMARK", "object": {
                    "apiVersion": res.gv, "kind": res.kind,
                    "metadata": {"resourceVersion": str(self._last_rv)}}}).encode() + b"\n")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(1.0, max(0.01, deadline - loop.time())))
                except asyncio.TimeoutError:
                    pass
        return rsp


class ThreadedEmulator:
    """The emulator on its own event loop in a thread, with a thread-safe API for tests."""

    def __init__(self) -> None:
        self.emu = Emulator()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="k8s-emulator", daemon=True)

    def __enter__(self) -> ThreadedEmulator:
        self._thread.start()
        self.call(self.emu.start)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.call(self.emu.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        async def run() -> Any:
            out = fn(*args, **kw)
            return await out if asyncio.iscoroutine(out) else out
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    # Convenience, by apiVersion/kind.
    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        res = self.emu.res_of(obj["apiVersion"], obj["kind"])
        return self.call(self.emu.create, res, obj["metadata"].get("namespace", ""), obj)

    def get(self, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        res = self.emu.res_of(api_version, kind)
        return self.call(lambda: copy.deepcopy(self.emu.objects.get((res, ns, name))))

    def list(self, api_version: str, kind: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        return self.call(self.emu.list, self.emu.res_of(api_version, kind), ns, selector)

    def patch(self, api_version: str, kind: str, ns: str, name: str, patch: Any, sub: str | None = None) -> dict[str, Any]:
        res = self.emu.res_of(api_version, kind)
        return self.call(self.emu.patch, res, ns, name, patch, "application/merge-patch+json", sub)

    def delete(self, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any]:
        return self.call(self.emu.delete, self.emu.res_of(api_version, kind), ns, name)

    def set_log(self, ns: str, pod: str, text: str) -> None:
        self.call(lambda: self.emu.logs.__setitem__((ns, pod), text))

    def kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": self.emu.url}}],
            "users": [{"name": "emu", "user": {"token": "emulator"}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}],
        }
