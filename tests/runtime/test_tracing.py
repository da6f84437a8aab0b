"""--otlp-endpoint / --otlp-service-name: request spans reach an OTLP/HTTP collector (one run by the test)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, free_port, launch


def _value(v):
    return getattr(v, v.WhichOneof("value"))


class Collector:
    """A loopback OTLP/HTTP trace receiver: every span it was sent, with its service name."""

    def __init__(self):
        self.spans: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest.FromString(await request.read())
        for rs in msg.resource_spans:
            service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({"name": s.name, "service": service, "trace": s.trace_id.hex(),
                                       "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                       "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                       "attributes": {a.key: _value(a.value) for a in s.attributes}})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def wait_for(self, count: int, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while len([s for s in self.spans if s["name"] == "request"]) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # poll interval of a deadline-bounded wait
        return self.spans


    async def __aenter__(self) -> Collector:
        app = web.Application()
        app.router.add_post("/v1/traces", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


async def test_request_spans_reach_the_collector(tmp_path):
    # The collector runs on this test's own event loop, which serves it while the test awaits.
    async with Collector() as collector:
        spans = await traced_requests(collector, tmp_path)
    check_spans(spans)


async def traced_requests(collector: Collector, tmp_path) -> list[dict]:
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    srv = launch(model_dir, tmp_path, *SMALL_ARGS, "--otlp-endpoint", collector.endpoint,
                 "--otlp-service-name", "tiny-llm", env=dict(SMALL_ENV, OTEL_BSP_SCHEDULE_DELAY="100"))
    try:
        await asyncio.to_thread(srv.wait_ready)
        async with aiohttp.ClientSession() as s:
            body = {"inputs": "hello world", "parameters": {"max_new_tokens": 5, "ignore_eos": True}}
            async with s.post(srv.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
            async with s.post(srv.url + "/generate", json={"inputs": "hi", "parameters": {"top_k": -1}}) as r:
                assert r.status == 422
        return await collector.wait_for(2)
    finally:
        srv.stop()


def check_spans(spans: list[dict]) -> None:
    assert {s["service"] for s in spans} == {"tiny-llm"}
    roots = {s["attributes"]["status"]: s for s in spans if s["name"] == "request"}
    assert set(roots) == {"success", "validation"}

    def children(root):
        kids = sorted((s for s in spans if s["parent"] == root["id"]), key=lambda s: s["start"])
        assert all(k["trace"] == root["trace"] and root["start"] <= k["start"] <= k["end"] <= root["end"]
                   for k in kids)
        return kids

    ok = roots["success"]
    assert [k["name"] for k in children(ok)] == ["validation", "queue", "prefill", "decode"]
    assert ok["attributes"]["generated_tokens"] == 5 and ok["attributes"]["finish_reason"] == "length"
    assert ok["attributes"]["input_tokens"] > 0
    assert [k["name"] for k in children(roots["validation"])] == ["validation"]
    assert roots["validation"]["trace"] != ok["trace"]  # one trace per request
