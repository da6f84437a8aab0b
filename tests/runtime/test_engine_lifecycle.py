"""What a client of the real server notices about request life cycles: slots and KV blocks come
back when clients leave, overload is a 429, and the server keeps serving through it all."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, launch


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    srv = launch(model_dir, tmp_path_factory.mktemp("run"), "--dtype", "float32", "--max-input-tokens", "64",
                 "--max-total-tokens", "4096", "--max-batch-size", "8", "--max-concurrent-requests", "3",
                 "--block-size", "8",
                 env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


# Long enough that no stream can end before the test's next step, however fast the host.
LONG = 3000


def kv_all_free(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        _, info = get_json(url + "/info")
        if info["kv_blocks_free"] == info["kv_blocks"] or time.monotonic() > deadline:
            return info
        time.sleep(0.05)  # poll interval of a deadline-bounded wait


async def read_events(resp, n):
    got = 0
    async for line in resp.content:
        if line.startswith(b"data:"):
            got += 1
            if got >= n:
                return


def test_client_disconnect_mid_stream_frees_slot_and_kv_blocks(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"inputs": "hello world", "parameters": {"max_new_tokens": LONG}}
            resp = await s.post(server.url + "/generate_stream", json=body)
            assert resp.status == 200
            await read_events(resp, 3)
            _, info = get_json(server.url + "/info")
            assert info["kv_blocks_free"] < info["kv_blocks"]
            resp.close()  # the client goes away mid-stream

    asyncio.run(run())
    info = kv_all_free(server.url)
    assert info["kv_blocks_free"] == info["kv_blocks"]
    # and the slot is back: max-concurrent-requests (3) requests still fit
    async def three():
        async with aiohttp.ClientSession() as s:
            rs = await asyncio.gather(*(s.post(server.url + "/generate", json={
                "inputs": "a", "parameters": {"max_new_tokens": 4}}) for _ in range(3)))
            return [r.status for r in rs]

    assert asyncio.run(three()) == [200, 200, 200]


def test_more_than_max_concurrent_requests_get_429_and_the_others_finish(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
            streams = [await s.post(server.url + "/generate_stream", json=body) for _ in range(3)]
            for r in streams:
                assert r.status == 200
                await read_events(r, 1)
            over = await s.post(server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
            over_body = await over.json()
            counts = []
            for r in streams:
                n = 0
                async for line in r.content:
                    if line.startswith(b"data:"):
                        n += 1
                        last = json.loads(line[5:])
                counts.append((n, last["details"]["finish_reason"]))
            return over.status, over_body, counts

    status, body, counts = asyncio.run(run())
    assert status == 429
    assert body["error_type"] == "overloaded"
    # each stream's remaining tokens arrived, ending on the length limit (EOS ignored)
    assert counts == [(LONG - 1, "length")] * 3
    assert kv_all_free(server.url)["kv_blocks_free"] > 0


def test_stop_sequence_ends_generation_and_is_reported(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            base = {"inputs": "What is deep learning?", "parameters": {"max_new_tokens": 30}}
            r = await s.post(server.url + "/generate", json=base)
            full = (await r.json())["generated_text"]
            stop = full[5:8]
            r = await s.post(server.url + "/generate", json={
                "inputs": base["inputs"], "parameters": {"max_new_tokens": 30, "stop": [stop], "details": True}})
            return full, stop, await r.json()

    full, stop, data = asyncio.run(run())
    assert data["details"]["finish_reason"] == "stop_sequence"
    assert data["generated_text"].endswith(stop) or stop in data["generated_text"]
    assert len(data["generated_text"]) < len(full)


def test_same_seed_same_text_and_seed_reported(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            outs = []
            for seed in (11, 11, 12):
                r = await s.post(server.url + "/generate", json={"inputs": "the gaudi", "parameters": {
                    "max_new_tokens": 16, "do_sample": True, "temperature": 0.9, "top_k": 50, "seed": seed,
                    "details": True}})
                outs.append(await r.json())
            return outs

    a, b, c = asyncio.run(run())
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["seed"] == 11
    assert [t["id"] for t in a["details"]["tokens"]] != [t["id"] for t in c["details"]["tokens"]]


BAD_INPUTS = [
    (b"{not json", 422),
    (json.dumps({"parameters": {"max_new_tokens": 4}}).encode(), 422),  # no inputs
    (json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 0}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 5000}}).encode(), 422),
    (json.dumps({"inputs": "hello " * 200, "parameters": {"max_new_tokens": 4}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"temperature": 0}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"temperature": -1}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"top_p": 1.5}}).encode(), 422),
    (json.dumps({"inputs": "hi", "parameters": {"best_of": 2}}).encode(), 422),
    (json.dumps({"inputs": "", "parameters": {"max_new_tokens": 4}}).encode(), 422),
    (b"{\"inputs\": \"\xff\xfe\"}", 422),  # invalid UTF-8
]


def test_bad_input_gets_tgi_errors_while_other_requests_are_served(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            ok = asyncio.create_task(s.post(server.url + "/generate", json={
                "inputs": "hello world", "parameters": {"max_new_tokens": 60}}))
            results = []
            for body, _ in BAD_INPUTS:
                async with s.post(server.url + "/generate", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    results.append((r.status, await r.json()))
            good = await ok
            return results, good.status, await good.json()

    results, status, good = asyncio.run(run())
    for (body, expected), (code, err) in zip(BAD_INPUTS, results):
        assert code == expected, (body, code, err)
        assert err["error_type"] == "validation" and err["error"], (body, err)
    assert status == 200 and good["generated_text"]
