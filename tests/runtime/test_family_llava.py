"""Llava-v1.6 (LlavaNext) with images in the prompt, served through HTTP, equals transformers.

A tiny random-weight Llava-NeXT (CLIP tower on 32-pixel tiles, a Mistral language model,
the 1x2 / 2x1 / 2x2 tile grids) answers prompts holding images generated here, given as TGI
takes them: `![](data:image/png;base64,...)` in `inputs`, `image_url` parts in chat messages,
and an http URL the router fetches (from a server on loopback). Greedy tokens must equal
`LlavaNextForConditionalGeneration.generate` in fp32 on the processor's inputs, alone and in a
concurrent batch mixing images and text, with 1 and 2 shards; bad images get a 422.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import serve
from tests.runtime.launched import get_json, launch

# Image tokens of the test images: (40x70) 52, (100x30) 40, (17x23) 44, (64x64) 88.
MAX_INPUT_TOKENS = 80
ARGS = ["--dtype", "float32", "--max-input-tokens", str(MAX_INPUT_TOKENS), "--max-total-tokens", "128",
        "--max-batch-size", "8", "--max-batch-prefill-tokens", "256", "--block-size", "4",
        "--max-concurrent-requests", "64"]
ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2",
       "BASE_IMAGE_TOKENS": "48", "MAX_IMAGE_BYTES": "20000", "IMAGE_FETCH_TIMEOUT_S": "2",
       # Loopback is not fetched from unless allow-listed; `localhost` stays out, to be refused.
       "ALLOWED_MEDIA_DOMAINS": "127.0.0.1",
       # While a batch runs, waiting prompts are held until it ends (or 20 steps), so prompts sent
       # together share a prefill even when the router takes them in one by one.
       "WAITING_SERVED_RATIO": "100", "QUEUE_THRESHOLD_MS": "60000"}


def png(height: int, width: int, seed: int = 0) -> bytes:
    """A colour gradient with a seeded tint: different images give different answers."""
    rng = np.random.default_rng(seed)
    a = np.zeros((height, width, 3), np.uint8)
    a[..., 0] = np.linspace(0, 255, width)[None, :]
    a[..., 1] = np.linspace(255, 0, height)[:, None]
    a[..., 2] = rng.integers(0, 256)
    return encode(a)


def encode(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# (text before, image (height, width, seed) or None, text after, max_new_tokens)
CASES = [
    ("question: ", (40, 70, 1), "\nwhat is the data? answer:", 16),
    ("", (100, 30, 2), " describe the weight layer", 12),
    ("tell me: ", (17, 23, 3), "", 20),
    ("shard router cache", None, " answer", 10),
    ("a ", (40, 70, 4), " b", 8),
]

_REF: dict = {}


def reference(model_dir, before: str, image, after: str, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for the prompt with `<image>` where the image is."""
    import torch
    import transformers
    from PIL import Image

    key = str(model_dir)
    if key not in _REF:
        _REF[key] = (transformers.AutoProcessor.from_pretrained(model_dir),
                     transformers.LlavaNextForConditionalGeneration.from_pretrained(
                         model_dir, dtype=torch.float32).eval())
    proc, model = _REF[key]
    text = before + ("<image>" if image else "") + after
    pil = None if image is None else Image.open(io.BytesIO(png(*image)))
    inputs = proc(images=pil, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def prompt(before: str, image, after: str) -> str:
    return before + ("" if image is None else f"![]({data_url(png(*image))})") + after


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llava"), "llava")
    randomize_vectors(path)  # norm weights, biases and image_newline away from their constant init
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve_llava(model_dir, tmp_path_factory.mktemp(f"llava-{request.param}"), request.param)
    yield srv
    srv.stop()


def serve_llava(model_dir, tmp, shards: int):
    """family_parity.serve with limits that leave room for an image in a prompt."""
    return serve(model_dir, tmp, shards, args=tuple(ARGS), base_env=ENV)


async def generate(session, url: str, inputs: str, max_new_tokens: int) -> tuple[int, dict]:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    async with session.post(url + "/generate", json=body) as r:
        return r.status, await r.json()


def ids_of(status: int, body: dict) -> list[int]:
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]]


def test_image_prompts_one_at_a_time_match_transformers(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            return [ids_of(*await generate(s, server.url, prompt(b, im, a), n)) for b, im, a, n in CASES[:3]]

    for (b, im, a, n), got in zip(CASES, asyncio.run(run())):
        assert got == reference(server.model_dir, b, im, a, n), (b, im, a)


def prefill_count(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('tgi_batch_inference_duration_count{method="prefill"}'):
                return int(float(line.split()[-1]))
    return 0


def test_concurrent_image_and_text_prompts_match_transformers(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(generate(s, server.url, prompt(b, im, a), n) for b, im, a, n in CASES))

    before = prefill_count(server.url)
    results = asyncio.run(run())
    assert prefill_count(server.url) - before < len(CASES)  # some prefill held several prompts (and images)
    for (b, im, a, n), result in zip(CASES, results):
        assert ids_of(*result) == reference(server.model_dir, b, im, a, n), (b, im, a)
    code, info = get_json(server.url + "/info")
    assert code == 200
    assert info["kv_blocks_free"] == info["kv_blocks"]
    assert info["unwarmed_shapes"] == 0


def test_cached_image_blocks_are_read_only_by_the_same_image(server):
    """Prefix caching: the same image twice reads its blocks, the first time cut through the image's
    placeholders; another image behind the same text reads only the text's blocks."""
    text = "shard router cache token batch stream serve request answer question: "
    cases = [(text, (40, 70, 7), " what", 8), (text, (40, 70, 7), " what", 8), (text, (40, 70, 8), " what", 8),
             CASES[4], CASES[4]]

    async def run():
        async with aiohttp.ClientSession() as s:
            out = []
            for b, im, a, n in cases:
                before = get_json(server.url + "/info")[1]["prefix_cache_hits"]
                ids = ids_of(*await generate(s, server.url, prompt(b, im, a), n))
                out.append((ids, get_json(server.url + "/info")[1]["prefix_cache_hits"] - before))
            return out

    results = asyncio.run(run())
    for (b, im, a, n), (ids, _) in zip(cases, results):
        assert ids == reference(server.model_dir, b, im, a, n), (b, im, a)
    first, same, other, _, cut = (hits for _, hits in results)
    assert same > 52 > other > 0  # past the image's 52 placeholders; only the text before it
    assert cut > 0


def test_chat_image_url_part_matches_transformers(server):
    image = (100, 30, 5)
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(*image))}},
        {"type": "text", "text": "\nwhat is this"}]}], "max_tokens": 12, "temperature": 0, "logprobs": True}

    async def run():
        async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.json()

    status, out = asyncio.run(run())
    assert status == 200, out
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(server.model_dir)
    templated = tok.apply_chat_template([{"role": "user", "content": "<image>\nwhat is this"}], tokenize=False,
                                        add_generation_prompt=True)
    before, after = templated.split("<image>")
    want = reference(server.model_dir, before, image, after, 12)
    assert out["choices"][0]["message"]["content"] == tok.decode(want)
    assert out["usage"]["prompt_tokens"] > 40  # the image's 40 placeholder tokens count as prompt


class ImageHost:
    """An HTTP server on loopback serving one image, a 404 and a request that never answers;
    `requests` lists the paths it was asked for."""

    def __init__(self, data: bytes):
        self.data = data
        self.requests: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.release = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def image(_):
            return web.Response(body=self.data, content_type="image/png")

        async def hang(_):
            await self.release.wait()
            return web.Response(body=b"")

        async def start():
            self.release = asyncio.Event()

            @web.middleware
            async def record(request, handler):
                self.requests.append(request.path)
                return await handler(request)

            app = web.Application(middlewares=[record])
            app.router.add_get("/cat.png", image)
            app.router.add_get("/slow.png", hang)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        self.loop.run_until_complete(start())
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def stop():
            self.release.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_http_image_url_is_fetched_and_matches_transformers(server):
    image = (40, 70, 6)
    host = ImageHost(png(*image))
    try:
        async def run(url):
            async with aiohttp.ClientSession() as s:
                return await generate(s, server.url, f"look ![]({url}) here", 10)

        assert ids_of(*asyncio.run(run(host.url + "/cat.png"))) == reference(
            server.model_dir, "look ", image, " here", 10)
        status, body = asyncio.run(run(host.url + "/missing.png"))
        assert status == 422 and "HTTP 404" in body["error"], body
        status, body = asyncio.run(run(host.url + "/slow.png"))
        assert status == 422 and "within 2s" in body["error"], body
        asked = list(host.requests)
        status, body = asyncio.run(run(host.url.replace("127.0.0.1", "localhost") + "/cat.png"))
        assert status == 422 and "not in --allowed-media-domains" in body["error"], body
        assert host.requests == asked  # refused before any connection
    finally:
        host.close()


def test_image_features_match_transformers(model_dir):
    """Tower, projector and anyres packing on every tile grid (1x2, 2x1, 2x2), letterboxed either way."""
    import torch
    import transformers
    from PIL import Image

    from gaudi_runtime.models import load_model
    from gaudi_runtime.models.llava_next import load_image_processor, pixel_inputs

    ours = load_model(str(model_dir), torch.float32, "cpu")
    ref = transformers.LlavaNextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_processor = transformers.AutoProcessor.from_pretrained(model_dir).image_processor
    processor = load_image_processor(str(model_dir))
    for h, w in [(40, 70), (70, 40), (64, 64), (100, 30), (17, 23), (3, 200), (200, 3)]:
        data = png(h, w)
        inputs = ref_processor(Image.open(io.BytesIO(data)), return_tensors="pt")
        with torch.no_grad():
            want = torch.cat(ref.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output)
            got = ours.image_features(*pixel_inputs(processor, [data]))
        assert got.shape == want.shape, (h, w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BAD_IMAGES = [
    ("undecodable", f"x ![]({data_url(b'definitely not a picture')}) y", "image 0: invalid image: cannot decode it"),
    ("bad-base64", "x ![](data:image/png;base64,@@@@) y", "image 0: invalid image: the data URL is not valid base64"),
    ("over-byte-limit",
     f"x ![]({data_url(encode(np.random.default_rng(0).integers(0, 256, (90, 90, 3), dtype=np.uint8)))})",
     "image 0: image too large"),
    ("over-max-input-tokens", f"a ![]({data_url(png(17, 23))}) b ![]({data_url(png(64, 64))})",
     "image 1 (64x64) takes 88 tokens, more than `--max-input-tokens` (80)"),
    ("images-together-too-long", f"![]({data_url(png(40, 70))}) ![]({data_url(png(17, 23))})",
     f"`inputs` must have less than {MAX_INPUT_TOKENS} tokens"),
    ("placeholder-as-text", "a literal <image> placeholder", "contains the image placeholder `<image>` as text"),
    ("unsupported-url", "x ![](ftp://example.com/a.png)", "image 0: invalid image: the URL must be a data: URL or http(s)"),
]


@pytest.mark.parametrize("inputs, message", [(i, m) for _, i, m in BAD_IMAGES], ids=[n for n, _, _ in BAD_IMAGES])
def test_bad_images_get_422(server, inputs, message):
    async def run():
        async with aiohttp.ClientSession() as s:
            return await generate(s, server.url, inputs, 4)

    status, body = asyncio.run(run())
    assert status == 422, body
    assert body["error_type"] == "validation"
    assert message in body["error"], body
    code, health = get_json(server.url + "/health")  # the engine keeps serving
    assert code == 200, health


def test_start_refuses_max_input_tokens_below_base_image_tokens(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, "--device", "cpu", *ARGS, env={**ENV, "BASE_IMAGE_TOKENS": "2048"})
    try:
        assert srv.proc.wait(timeout=120) != 0
    finally:
        srv.stop()
    assert "--max-input-tokens (80) is below BASE_IMAGE_TOKENS (2048)" in srv.log()
