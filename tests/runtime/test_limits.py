"""What one request may carry, over HTTP: every limit is a setting, an over-limit request gets a
422 or 413 in TGI's error JSON naming the limit, and the server keeps serving. Image URLs that point
inside the cluster are refused before any connection."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import numpy as np
import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.image_geometry import ImageGeometry
from gaudi_runtime.router.images import ImagePrompter
from gaudi_runtime.router.server import build_app
from tests.runtime.conftest import SERVER_ENV
from tests.runtime.fake_engine import FakeEngine, ServerThread
from tests.runtime.test_http_api import assert_error, call

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


async def _still_serves(url: str) -> None:
    status, body, _ = await call(url, "/generate", {"inputs": "hello"})
    assert status == 200 and body["generated_text"] == "hello", body


async def test_request_body_size(make_server):
    s = make_server(MAX_REQUEST_BYTES="1000")
    status, body, _ = await call(s.url, "/generate", {"inputs": "x" * 2000})
    assert_error(status, body, 413, "validation", "more than --max-request-bytes (1000)")
    assert "2014 bytes" in body["error"]  # the declared length, refused before reading

    async def chunks():
        yield b'{"inputs": "'
        for _ in range(20):
            yield b"y" * 100
        yield b'"}'

    async with aiohttp.ClientSession() as session:  # no Content-Length: refused while reading
        async with session.post(s.url + "/generate", data=chunks()) as r:
            assert_error(r.status, await r.json(), 413, "validation", "more than --max-request-bytes (1000)")
    await _still_serves(s.url)


@pytest.mark.parametrize("path, body, message", [
    ("/generate", {"inputs": "a", "parameters": {"stop": ["1", "2", "3"]}},
     "`stop` supports up to 2 stop sequences. Given: 3"),
    ("/v1/completions", {"prompt": "a", "stop": ["1", "2", "3"]}, "`stop` supports up to 2 stop sequences. Given: 3"),
    ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": 4}}, "`top_n_tokens` must be >= 0 and <= 3. Given: 4"),
    ("/v1/completions", {"prompt": "a", "logprobs": 4}, "`logprobs` must be <= 3 (--max-top-n-tokens). Given: 4"),
    ("/generate", {"inputs": "a", "parameters": {"best_of": 4, "do_sample": True}},
     "`best_of` must be > 0 and <= 3. Given: 4"),
    ("/generate", {"inputs": "a", "parameters": {"grammar": {"type": "json", "value": _nested(6)}}},
     "`grammar` is nested more than 5 levels deep (--max-json-schema-depth)"),
    ("/generate", {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "a" * 600}}},
     "`grammar` is 600 bytes, more than --max-json-schema-bytes (512)"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _nested(5)}}},
     "`response_format.json_schema.schema` is nested more than 5 levels deep"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["z" * 600]}}}]},
     "`tools[0].function.parameters` is 613 bytes, more than --max-json-schema-bytes (512)"),
    ("/generate", {"inputs": "[" * 50_000 + "]" * 50_000}, None),  # a long prompt, not a deep body: served
    ("/generate", {"inputs": "a", "parameters": json.loads("[" * 10 + "]" * 10)}, "`parameters`: expected an object"),
], ids=["stop", "stop-openai", "top_n_tokens", "logprobs", "best_of", "grammar-depth", "grammar-bytes",
        "response-format-depth", "tool-bytes", "long-prompt", "parameters-type"])
async def test_each_limit_is_a_setting_named_by_its_error(make_server, path, body, message):
    s = make_server(MAX_STOP_SEQUENCES="2", MAX_TOP_N_TOKENS="3", MAX_BEST_OF="3", MAX_JSON_SCHEMA_DEPTH="5",
                    MAX_JSON_SCHEMA_BYTES="512", MAX_INPUT_TOKENS="64", MAX_TOTAL_TOKENS="128")
    status, got, _ = await call(s.url, path, body)
    if message is None:
        assert status in (200, 422) and (status == 200 or "tokens" in got["error"]), got
    else:
        assert_error(status, got, 422, "validation", message)
    await _still_serves(s.url)


async def test_a_body_nested_past_the_json_parser_is_a_422(fake_server):
    deep = b'{"inputs": "a", "parameters": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    status, body, _ = await call(fake_server.url, "/generate", data=deep,
                                 headers={"Content-Type": "application/json"})
    assert_error(status, body, 422, "validation", "nested too deeply")
    await _still_serves(fake_server.url)


# --- images: how many, and from where ------------------------------------------------------------

TINY = ImageGeometry.from_config({"vision_config": {"image_size": 32, "patch_size": 8},
                                  "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]]})


def _png_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), 128, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def image_server(tiny_model_dir, router_tokenizer):
    """The HTTP layer with a vision model's image handling (over the fake engine)."""
    servers = []

    def make(**env: str):
        config = resolve(None, {"MODEL_ID": tiny_model_dir, **SERVER_ENV, **env})
        app = build_app(config, FakeEngine(router_tokenizer), router_tokenizer,
                        images=ImagePrompter(TINY, 99, config.limits))
        servers.append(ServerThread(app).start())
        return servers[-1].url

    yield make
    for s in servers:
        s.stop()


class Listener:
    """Counts the TCP connections made to it on 127.0.0.1."""

    def __init__(self):
        self.connections = 0

    async def __aenter__(self):
        async def accept(reader, writer):
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()


async def test_image_urls_inside_the_cluster_are_refused_before_any_connection(image_server):
    url = image_server()
    async with Listener() as listener:
        for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
            image = f"http://{host}:{listener.port}/latest/meta-data"
            status, body, _ = await call(url, "/generate", {"inputs": f"look ![]({image})"})
            assert_error(status, body, 422, "validation", "not public; allow the host with --allowed-media-domains")
            status, body, _ = await call(url, CHAT, {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}]}]})
            assert_error(status, body, 422, "validation", "not public")
        assert listener.connections == 0
    await _still_serves(url)


async def test_disabled_image_urls_and_the_image_count(image_server):
    url = image_server(DISABLE_IMAGE_URLS="true", MAX_IMAGES_PER_REQUEST="2")
    status, body, _ = await call(url, "/generate", {"inputs": "![](https://images.example.com/cat.png)"})
    assert_error(status, body, 422, "validation", "image URLs are disabled on this server (--disable-image-urls)")
    three = "".join(f"![]({_png_url()})" for _ in range(3))
    status, body, _ = await call(url, "/generate", {"inputs": three})
    assert_error(status, body, 422, "validation", "the prompt holds 3 images, more than --max-images-per-request (2)")
    await _still_serves(url)
