"""Images in prompts: markdown parsing, data URLs, decoding, fetching (on loopback), expansion
into placeholder tokens, and the start-up image budget. Every bad image is a ValidationError
(HTTP 422) that says which image and why."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from aiohttp import web

from gaudi_runtime.config import Config, ConfigError
from gaudi_runtime.image_geometry import ImageGeometry
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.images import (
    ImagePrompter,
    check_image_budget,
    decode_data_url,
    image_size,
    split_markdown,
)
from gaudi_runtime.router.media_fetch import FetchPolicy, fetch_url

TINY = ImageGeometry.from_config({"vision_config": {"image_size": 32, "patch_size": 8},
                                  "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]]})
IMAGE_ID = 99


def png(height: int, width: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_split_markdown_keeps_text_and_finds_images():
    assert split_markdown('a ![](x.png) b ![alt](data:image/png;base64,AAAA "title")c') == [
        "a ", ("x.png",), " b ", ("data:image/png;base64,AAAA",), "c"]
    assert split_markdown("no images [here](x)") == ["no images [here](x)"]


def test_data_urls():
    data = png(3, 4)
    assert decode_data_url(url(data), 10_000) == data
    assert decode_data_url("data:image/png;charset=x;base64," + base64.b64encode(b"ab").decode(), 10) == b"ab"
    with pytest.raises(ValidationError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@@", 100)
    with pytest.raises(ValidationError, match="must be `data:image/<type>;base64,<data>`"):
        decode_data_url("data:image/png,rawbytes", 100)
    with pytest.raises(ValidationError, match="image too large: more than 10 bytes"):
        decode_data_url(url(b"x" * 100), 10)


def test_image_size_decodes_fully():
    assert image_size(png(5, 7)) == (5, 7)
    with pytest.raises(ValidationError, match="invalid image: cannot decode it"):
        image_size(b"GIF89a not really")
    with pytest.raises(ValidationError, match="invalid image: cannot decode it"):
        image_size(png(50, 50)[:60])  # a truncated PNG: the header alone is not enough
    with pytest.raises(ValidationError, match="image too large: 9000x8000 pixels"):
        image_size(png_header(9000, 8000))  # refused from its header, before decoding 216 MB


def png_header(width: int, height: int) -> bytes:
    """A PNG declaring the size, with no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b"") + chunk(b"IEND", b""))


def prompter(**overrides) -> ImagePrompter:
    cfg = Config.of(model_id="m", max_input_tokens=80, max_total_tokens=128, **overrides)
    return ImagePrompter(TINY, IMAGE_ID, cfg.limits)


def test_expand_replaces_each_image_by_its_tokens():
    out = asyncio.run(prompter().expand(f"a ![]({url(png(40, 70))}) b ![]({url(png(17, 23))})"))
    assert out.token_counts == [52, 44]
    assert out.text == "a " + "<image>" * 52 + " b " + "<image>" * 44
    assert out.images == [png(40, 70), png(17, 23)]
    plain = asyncio.run(prompter().expand("no image"))
    assert plain.text == "no image" and plain.images == []


@pytest.mark.parametrize("text, message", [
    (f"x ![]({url(png(64, 64))})", "image 0 (64x64) takes 88 tokens, more than `--max-input-tokens` (80)"),
    (f"![]({url(png(2, 2))}) ![]({url(b'nope')})", "image 1: invalid image: cannot decode it"),
    ("![](file:///etc/passwd)", "image 0: invalid image: the URL must be a data: URL or http(s)"),
    ("<image> as text", "contains the image placeholder `<image>` as text"),
])
def test_expand_errors(text, message):
    with pytest.raises(ValidationError) as e:
        asyncio.run(prompter().expand(text))
    assert message in str(e.value)


def test_expand_refuses_more_images_than_the_limit_before_fetching_any():
    text = "".join(f"![](http://127.0.0.1:9/{i}.png)" for i in range(3))  # port 9: nothing is fetched
    with pytest.raises(ValidationError, match=r"holds 3 images, more than --max-images-per-request \(2\)"):
        asyncio.run(prompter(max_images_per_request=2).expand(text))


def test_expand_applies_the_byte_limit():
    with pytest.raises(ValidationError, match="image 0: image too large"):
        asyncio.run(prompter(max_image_bytes=50).expand(f"![]({url(png(40, 40))})"))


def test_place_checks_placeholders_and_truncation():
    from gaudi_runtime.router.images import PromptImages

    ids = [1, IMAGE_ID, IMAGE_ID, 2]
    prompt = PromptImages(text="", image_token_id=IMAGE_ID, images=[b"i"], token_counts=[2])
    assert prompt.place(ids, len(ids)) == ([b"i"], [1])
    with pytest.raises(ValidationError, match="`truncate` cannot cut a prompt that holds images"):
        prompt.place(ids, len(ids) + 1)
    with pytest.raises(ValidationError, match="has 2 image placeholder tokens but its images need 3"):
        PromptImages(text="", image_token_id=IMAGE_ID, images=[b"i"], token_counts=[3]).place(ids, len(ids))


async def _serve(handlers: dict):
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


LOOPBACK = FetchPolicy(allowed_hosts=frozenset({"127.0.0.1"}))  # loopback is refused unless allow-listed


def test_fetch_on_loopback():
    """The image, then every error path: 404, a declared or streamed size over the limit, a timeout,
    nothing listening."""
    data = png(20, 20)

    async def run():
        never = asyncio.Event()

        async def image(_):
            return web.Response(body=data, content_type="image/png")

        async def streamed(request):
            resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
            await resp.prepare(request)
            for _ in range(10):
                await resp.write(b"x" * 1000)
            return resp

        async def hang(_):
            await never.wait()

        runner, base = await _serve({"/a.png": image, "/big": streamed, "/hang": hang})
        errors = {}
        try:
            got = await fetch_url(base + "/a.png", 10_000, 5, LOOPBACK)
            for name, (path, limit, timeout) in {
                "404": ("/missing", 10_000, 5), "declared": ("/a.png", 10, 5), "streamed": ("/big", 5_000, 5),
                "timeout": ("/hang", 10_000, 0.3),
            }.items():
                with pytest.raises(ValidationError) as e:
                    await fetch_url(base + path, limit, timeout, LOOPBACK)
                errors[name] = str(e.value)
        finally:
            never.set()
            await runner.cleanup()
        with pytest.raises(ValidationError) as e:
            await fetch_url(base + "/a.png", 10_000, 5, LOOPBACK)  # the server is gone
        errors["refused"] = str(e.value)
        return got, errors

    got, errors = asyncio.run(run())
    assert got == data
    assert "HTTP 404" in errors["404"]
    assert f"has {len(data)} bytes, more than 10" in errors["declared"]
    assert "has more than 5000 bytes" in errors["streamed"]
    assert "no answer within 0.3s" in errors["timeout"]
    assert errors["refused"].startswith("could not fetch image")


def test_start_needs_max_input_tokens_for_an_image():
    llava = {"architectures": ["LlavaNextForConditionalGeneration"]}
    small = Config.of(model_id="m", max_input_tokens=1024, max_total_tokens=2048)
    with pytest.raises(ConfigError, match=r"--max-input-tokens \(1024\) is below BASE_IMAGE_TOKENS \(2048\)"):
        check_image_budget(small.limits, llava)
    check_image_budget(Config.of(model_id="m", max_input_tokens=2048, max_total_tokens=4096).limits, llava)
    check_image_budget(small.limits, {"architectures": ["LlamaForCausalLM"]})  # text models have no image budget


def _messages(body: dict, images_allowed: bool = False) -> list[dict]:
    from gaudi_runtime.router.openai_validation import chat_messages
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    return chat_messages(parse_request(ChatCompletionRequest, body).messages, images_allowed=images_allowed)


def test_chat_image_url_parts_become_markdown():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}
    assert _messages(body, images_allowed=True)[0]["content"] == "see ![](data:image/png;base64,AA)"
    with pytest.raises(ValidationError, match="this model takes no images"):
        _messages(body)
    body["messages"][0]["content"][1] = {"type": "image_url", "image_url": {}}
    with pytest.raises(ValidationError, match="an `image_url` part needs a string `url`"):
        _messages(body, images_allowed=True)
