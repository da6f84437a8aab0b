"""The only module that talks to the Kubernetes API server (and to the runtime pods).

Uses the official `kubernetes` client (its configuration: in-cluster or
kubeconfig, the same one Kopf logs in with) in worker threads, so the event
loop never blocks. Children are written with server-side apply under the
field manager `gaudi-serve-operator`, forced: the operator owns the fields it
renders and nothing else.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import re
import uuid
from typing import Any

import aiohttp
import kubernetes
from kubernetes.client.exceptions import ApiException

from .spec import FIELD_MANAGER, GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

# kind -> (api prefix, plural)
_KINDS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Job": ("/apis/batch/v1", "jobs"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "InferenceService": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}

_client: kubernetes.client.ApiClient | None = None

# An apply patch is YAML. JSON is YAML except for one thing: YAML has no surrogate pairs, so a
# character beyond U+FFFF (an emoji in an annotation), which json.dumps writes as two \uXXXX
# escapes, must go as one \UXXXXXXXX escape. (A backslash written as \\ is not an escape.)
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


class NotFound(Exception):
    pass


class Invalid(Exception):
    """The API server refused an object as invalid (400, 422); the message is its own, naming the field."""


class Conflict(Exception):
    """409: the object exists already (create), or changed since it was read (a write with its resourceVersion)."""


def configure() -> None:
    """Load the in-cluster config, else the kubeconfig ($KUBECONFIG): the same sources Kopf logs in with."""
    global _client
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    _client = kubernetes.client.ApiClient()


def _api() -> kubernetes.client.ApiClient:
    if _client is None:
        configure()
    assert _client is not None
    return _client


def resource(kind: str) -> tuple[str, str, str]:
    """(group, version, plural) of a kind, as Kopf names a resource to watch."""
    prefix, plural = _KINDS[kind]
    group_version = prefix.removeprefix("/apis/").removeprefix("/api/")
    group, _, version = group_version.rpartition("/")
    return group, version, plural


def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = _KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def _call(method: str, path: str, *, query: list[tuple[str, str]] | None = None, body: Any = None,
          content_type: str = "application/json", raw: bool = False) -> Any:
    api = _api()
    method_, url, headers, body_, post = api.param_serialize(
        method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
        header_params={"Content-Type": content_type, "Accept": "*/*" if raw else "application/json"})
    rsp = api.call_api(method_, url, headers, body_, post, _request_timeout=30)
    data = rsp.read()
    if rsp.status == 404:
        raise NotFound(path)
    if rsp.status in (400, 422):
        raise Invalid(_status_message(data) or f"{method} {path}: {rsp.reason}")
    if rsp.status == 409:
        raise Conflict(_status_message(data) or f"{method} {path}: {rsp.reason}")
    if not 200 <= rsp.status <= 299:
        raise ApiException(status=rsp.status, reason=f"{method} {path}: {rsp.reason}: {data[:500]!r}")
    if raw:
        return data.decode(errors="replace")
    return json.loads(data) if data else {}


def _status_message(data: bytes) -> str:
    try:
        status = json.loads(data)
    except ValueError:
        return ""
    return str(status.get("message") or "") if isinstance(status, dict) else ""


async def _run(method: str, path: str, **kw: Any) -> Any:
    return await asyncio.to_thread(_call, method, path, **kw)


def apply_body(obj: dict[str, Any]) -> str:
    """`obj` as the text of an apply patch: JSON, with the escapes YAML reads the same way."""
    def one(m: re.Match[str]) -> str:
        high, low = int(m.group(2), 16), int(m.group(3), 16)
        return f"{m.group(1)}\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08X}"
    return _SURROGATE_PAIR.sub(one, json.dumps(obj))


async def apply(obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply `obj` (forced, field manager gaudi-serve-operator); returns the live object."""
    meta = obj["metadata"]
    path = _path(obj["kind"], meta["namespace"], meta["name"])
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
    return await _run("PATCH", path, query=query, body=apply_body(obj), content_type="application/apply-patch+yaml")


async def get(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await _run("GET", _path(kind, namespace, name))
    except NotFound:
        return None


async def delete(kind: str, namespace: str, name: str, resource_version: str | None = None) -> bool:
    """Delete if present; False when it was not there. With `resource_version`, only that version
    of it (Conflict when it changed since)."""
    body: dict[str, Any] = {"propagationPolicy": "Background"}
    if resource_version:
        body["preconditions"] = {"resourceVersion": resource_version}
    try:
        await _run("DELETE", _path(kind, namespace, name), body=body)
        return True
    except NotFound:
        return False


async def create(obj: dict[str, Any]) -> dict[str, Any]:
    """Create `obj` as it is (Conflict when it exists): for objects the operator shares, never re-applies."""
    meta = obj["metadata"]
    return await _run("POST", _path(obj["kind"], meta["namespace"]), query=[("fieldManager", FIELD_MANAGER)],
                      body=obj)


async def patch_if_unchanged(obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch `obj` unless it changed since it was read (its resourceVersion; else Conflict)."""
    meta = obj["metadata"]
    body = {**patch, "metadata": {**(patch.get("metadata") or {}), "resourceVersion": meta["resourceVersion"]}}
    return await _run("PATCH", _path(obj["kind"], meta["namespace"], meta["name"]),
                      query=[("fieldManager", FIELD_MANAGER)], body=body, content_type="application/merge-patch+json")


async def pod_log(namespace: str, pod: str, container: str, *, tail_lines: int = 20,
                  limit_bytes: int = 64 * 1024) -> str | None:
    """The last lines of a container's log; None when the kubelet cannot give them (yet)."""
    query = [("container", container), ("tailLines", str(tail_lines)), ("limitBytes", str(limit_bytes))]
    try:
        return await _run("GET", _path("Pod", namespace, pod, "log"), query=query, raw=True)
    except Exception as exc:  # progress is best effort: a kubelet that does not answer stops no pass
        log.debug("log of pod %s/%s unavailable: %s", namespace, pod, exc)
        return None


async def list_objects(kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The objects of `kind` matching a label selector, each with its kind (a list's items carry none);
    none where the API server does not serve the kind. resourceVersion 0: from the API server's watch
    cache, as Kopf's watches are, not a quorum read per pass."""
    try:
        rsp = await _run("GET", _path(kind, namespace), query=[("labelSelector", selector), ("resourceVersion", "0")])
    except NotFound:
        return []
    return [{**item, "kind": kind} for item in rsp.get("items") or []]


async def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    rsp = await _run("GET", _path("Pod", namespace), query=[("labelSelector", selector)])
    return list(rsp.get("items") or [])


async def patch_status(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
    """JSON-merge-patch the status subresource; None when the object is gone."""
    try:
        return await _run("PATCH", _path("InferenceService", namespace, name, "status"),
                          body={"status": patch}, content_type="application/merge-patch+json")
    except NotFound:
        return None


async def post_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Record a core/v1 Event about `body`; failures are logged, never raised."""
    meta = body["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion", f"{GROUP}/{VERSION}"),
                           "kind": body.get("kind", "InferenceService"), "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await _run("POST", _path("Event", meta["namespace"]), body=event)
    except Exception as exc:  # events are best effort
        log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], exc)


async def fetch_warmup(pods: list[dict[str, Any]], port: int, *, concurrency: int = 8,
                       timeout: float = 2.0) -> dict[str, dict[str, Any]]:
    """GET http://<podIP>:<port>/health of each running, not-ready pod; pod name -> its `warmup` object.

    Bounded concurrency and short timeouts; an unreachable pod or an answer
    without warmup progress is simply left out.
    """
    targets = []
    for pod in pods:
        st = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if st.get("phase") == "Running" and st.get("podIP") and not ready \
                and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            targets.append((pod["metadata"]["name"], st["podIP"]))
    if not targets:
        return {}
    sem = asyncio.Semaphore(concurrency)
    out: dict[str, dict[str, Any]] = {}
    client_timeout = aiohttp.ClientTimeout(total=timeout, connect=timeout)

    async def one(session: aiohttp.ClientSession, pod: str, ip: str) -> None:
        host = f"[{ip}]" if ":" in ip else ip
        async with sem:
            try:
                async with session.get(f"http://{host}:{port}/health") as rsp:
                    data = json.loads(await rsp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
                log.debug("warmup progress of pod %s unavailable: %s", pod, exc)
                return
        warm = data.get("warmup") if isinstance(data, dict) else None
        if isinstance(warm, dict) and isinstance(warm.get("total"), int) and isinstance(warm.get("done"), int):
            out[pod] = warm

    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        await asyncio.gather(*(one(session, pod, ip) for pod, ip in targets))
    return out


async def fetch_health(pod: dict[str, Any], port: int, *, timeout: float = 2.0) -> dict[str, Any] | None:
    """A pod's /health answer (a dict), None when it cannot be had."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    client_timeout = aiohttp.ClientTimeout(total=timeout, connect=timeout)
    try:
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            async with session.get(f"http://{host}:{port}/health") as rsp:
                data = json.loads(await rsp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
        log.debug("/health of pod %s unavailable: %s", pod["metadata"].get("name"), exc)
        return None
    return data if isinstance(data, dict) else None
