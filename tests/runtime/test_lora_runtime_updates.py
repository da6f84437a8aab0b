"""LoRA adapters loaded and unloaded while serving (vLLM's `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, opt-in with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), as users run it:

* an adapter loaded while another request streams gives transformers + peft's greedy tokens, and the
  stream gives what it gives alone;
* unloaded, it is gone: /v1 404 model_not_found, TGI 422, a second unload vLLM's 404;
* a request in flight keeps its adapter through an unload: its device slot is not reused until it
  ends (an adapter loaded meanwhile takes another slot);
* an adapter reloaded with other weights under the same name (same directory) gives the new peft
  tokens with prefix caching on, a repeated prompt hitting the cache;
* bad input (a name taken, no path, a missing directory, a rank above --max-lora-rank, targets the
  model has not, an adapter of another base model, a corrupt file) is refused in vLLM's shape, and
  the adapters loaded before keep serving;
* without the opt-in the endpoints are absent (404), as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.conformance import Contract
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, get_json, launch
from tests.runtime.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.slow

PROMPT = "kubernetes pod operator cluster node graph warmup bucket prefill decode"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    adapters = {name: make_adapter(model_dir, tmp_path_factory.mktemp(name), seed=seed, rank=rank, targets=targets)
                for name, seed, rank, targets in [("sql", 1, 4, None), ("chat", 2, 2, ["q_proj", "v_proj"]),
                                                  ("code", 3, 4, ["o_proj", "down_proj"]), ("v2", 5, 4, None),
                                                  ("wide", 6, 8, None)]}
    return model_dir, adapters


@pytest.fixture(scope="module")
def server(made, tmp_path_factory):
    model_dir, adapters = made
    srv = launch(model_dir, tmp_path_factory.mktemp("server"), "--device", "cpu", *SMALL_ARGS,
                 "--model-name", "base", "--lora-modules", f"sql={adapters['sql']}", "--max-lora-rank", "4",
                 "--max-cpu-loras", "3", env={**SMALL_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        srv.wait_ready()
        srv.model_dir = model_dir
        yield srv
    finally:
        srv.stop()


async def post(session, url: str, body) -> tuple[int, object]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def load(session, server, name: str, path, **extra) -> tuple[int, object]:
    return await post(session, server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path),
                                                                      **extra})


async def unload(session, server, name: str) -> tuple[int, object]:
    return await post(session, server.url + "/v1/unload_lora_adapter", {"lora_name": name})


async def generate_ids(session, server, model: str, n: int = 12, prompt: str = PROMPT) -> list[int]:
    """Greedy token ids from TGI's /generate, with the adapter `model` (or the base model)."""
    params = {"max_new_tokens": n, "details": True, **({} if model == "base" else {"adapter_id": model})}
    async with session.post(server.url + "/generate", json={"inputs": prompt, "parameters": params}) as r:
        assert r.status == 200, await r.text()
        return [t["id"] for t in (await r.json())["details"]["tokens"]]


async def v1_status(session, server, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    async with session.post(server.url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


class Stream:
    """A long /generate_stream read in the background; `ids` so far, `done` once it ended."""

    def __init__(self, session, server, adapter: str | None, n: int = 100):
        params = {"max_new_tokens": n, "ignore_eos": True, **({"adapter_id": adapter} if adapter else {})}
        self.ids: list[int] = []
        self.done = asyncio.Event()
        self.task = asyncio.create_task(self._read(session, server.url, {"inputs": PROMPT, "parameters": params}))

    async def _read(self, session, url: str, body: dict) -> list[int]:
        async with session.post(url + "/generate_stream", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data:"):
                    self.ids.append(json.loads(line[5:])["token"]["id"])
        self.done.set()
        return self.ids

    async def started(self, deadline_s: float = 60.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not self.ids and time.monotonic() < deadline and not self.task.done():
            await asyncio.sleep(0.01)  # poll interval of a deadline-bounded wait
        assert self.ids and not self.done.is_set(), "the stream did not start or ended at once"


async def alone(session, server, adapter: str | None) -> list[int]:
    s = Stream(session, server, adapter)
    return await s.task


def test_an_adapter_loaded_while_a_stream_runs_gives_peft_tokens_and_leaves_the_stream_alone(server, made):
    model_dir, adapters = made

    async def run():
        async with aiohttp.ClientSession() as s:
            stream = Stream(s, server, "sql")
            await stream.started()
            answer = await load(s, server, "chat", adapters["chat"])
            during = not stream.done.is_set()
            got = await generate_ids(s, server, "chat")
            streamed = await stream.task
            return answer, during, got, streamed, await alone(s, server, "sql"), await get_models(s, server)

    answer, during, got, streamed, sql_alone, models = asyncio.run(run())
    assert answer == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert during, "the load ended after the stream: it did not run while serving"
    assert got == peft_greedy(model_dir, adapters["chat"], PROMPT, 12)
    assert got != peft_greedy(model_dir, None, PROMPT, 12)
    assert streamed == sql_alone
    assert {m["id"]: m["root"] for m in models if m["parent"] == "base"} == {
        "sql": str(adapters["sql"]), "chat": str(adapters["chat"])}


async def get_models(session, server) -> list[dict]:
    async with session.get(server.url + "/v1/models") as r:
        return (await r.json())["data"]


def test_an_unloaded_adapter_is_gone_for_new_requests(server, made):
    _, adapters = made

    async def run():
        async with aiohttp.ClientSession() as s:
            assert (await load(s, server, "code", adapters["code"]))[0] == 200
            answers = [await unload(s, server, "code"), await v1_status(s, server, "code")]
            params = {"max_new_tokens": 2, "adapter_id": "code"}
            answers.append(await post(s, server.url + "/generate", {"inputs": PROMPT, "parameters": params}))
            answers.append(await unload(s, server, "code"))
            return answers, await get_models(s, server)

    (unloaded, v1, tgi, again), models = asyncio.run(run())
    assert unloaded == (200, "Success: LoRA adapter 'code' removed successfully.")
    assert v1 == (404, {"error": {"message": "The model `code` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": "model_not_found"}})
    assert tgi[0] == 422 and "not a served adapter" in tgi[1]["error"]
    assert again == (404, {"error": {"message": "The lora adapter 'code' cannot be found.", "type": "NotFoundError",
                                     "param": None, "code": None}})
    assert "code" not in {m["id"] for m in models}
    _, info = get_json(server.url + "/info")
    assert "code" not in info["lora_adapters"] and info["runtime_lora_updating"] is True


def test_a_request_in_flight_keeps_its_adapter_through_an_unload(server, made):
    """Three device slots (--max-cpu-loras 3 alone keeps its meaning before: the slots): sql, chat and `code`
    streaming. `code` unloaded mid-stream keeps its slot; an adapter loaded meanwhile takes another one (the
    least recently used), and each gives its own tokens."""
    model_dir, adapters = made

    async def run():
        async with aiohttp.ClientSession() as s:
            for name in ("chat", "code"):
                if name not in {m["id"] for m in await get_models(s, server)}:
                    assert (await load(s, server, name, adapters[name]))[0] == 200
            before = await alone(s, server, "code")
            stream = Stream(s, server, "code")
            await stream.started()
            unloaded = await unload(s, server, "code")
            loaded = await load(s, server, "other", adapters["v2"])
            held = not stream.done.is_set()
            other = await generate_ids(s, server, "other")
            streamed = await stream.task
            await unload(s, server, "other")
            return before, unloaded, loaded, held, other, streamed

    before, unloaded, loaded, held, other, streamed = asyncio.run(run())
    assert unloaded[0] == 200 and loaded[0] == 200 and held
    assert other == peft_greedy(model_dir, adapters["v2"], PROMPT, 12)
    assert streamed == before
    _, info = get_json(server.url + "/info")
    assert (info["max_loras"], info["max_cpu_loras"]) == (3, 3)
    assert server.log().count("--max-cpu-loras 3 without --max-loras: 3 device slots, as before") == 1


def test_a_changed_adapter_reloaded_under_its_name_gives_the_new_tokens_with_the_cache_on(server, made, tmp_path):
    model_dir, adapters = made
    path = tmp_path / "v"
    shutil.copytree(adapters["chat"], path)
    old, new = peft_greedy(model_dir, path, PROMPT, 12), peft_greedy(model_dir, adapters["v2"], PROMPT, 12)
    assert old != new

    async def twice(s) -> list[list[int]]:
        return [await generate_ids(s, server, "v") for _ in range(2)]

    async def run():
        async with aiohttp.ClientSession() as s:
            for name in ("code", "other", "chat"):
                await unload(s, server, name)
            assert (await load(s, server, "v", path))[0] == 200
            first = await twice(s)
            for f in ("adapter_config.json", "adapter_model.safetensors"):  # new weights, same directory
                shutil.copy(adapters["v2"] / f, path / f)
            refused = await load(s, server, "v", path)
            _, hits = get_json(server.url + "/info")
            reloaded = await load(s, server, "v", path, load_inplace=True)
            second = await twice(s)
            _, after = get_json(server.url + "/info")
            await unload(s, server, "v")
            return first, refused, reloaded, second, hits["prefix_cache_hits"], after["prefix_cache_hits"]

    first, refused, reloaded, second, hits, hits_after = asyncio.run(run())
    assert first == [old, old]
    assert refused[0] == 400 and refused[1]["error"] == {
        "message": "The lora adapter 'v' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": None}
    assert reloaded == (200, "Success: LoRA adapter 'v' added successfully.")
    assert second == [new, new]
    assert hits_after > hits  # the repeat hit the new adapter's blocks (not the old one's: its tokens differ)


def _bad_adapters(made, tmp_path) -> dict:
    model_dir, adapters = made
    targets, corrupt = tmp_path / "targets", tmp_path / "corrupt"
    for d in (targets, corrupt):
        shutil.copytree(adapters["sql"], d)
    cfg = json.loads((targets / "adapter_config.json").read_text())
    (targets / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "w_gate"]}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    other = make_tiny_model(tmp_path / "other-base", "llama", size="overhead")
    return {"rank": adapters["wide"], "targets": targets, "corrupt": corrupt,
            "other_base": make_adapter(other, tmp_path / "other-adapter", seed=7)}


def test_bad_input_is_refused_clearly_and_the_loaded_adapters_keep_serving(server, made, tmp_path):
    model_dir, adapters = made
    bad = _bad_adapters(made, tmp_path)
    cases = [({"lora_name": "sql", "lora_path": str(adapters["sql"])}, 400, "has already been loaded"),
             ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
             ({"lora_name": "base", "lora_path": str(adapters["v2"])}, 400, "conflicts with a served base model"),
             ({"lora_name": "x", "lora_path": str(tmp_path / "absent")}, 404, "No adapter found for"),
             ({"lora_name": "x", "lora_path": str(bad["rank"])}, 400, "has rank 8, above --max-lora-rank 4"),
             ({"lora_name": "x", "lora_path": str(bad["targets"])}, 400, "targets w_gate, which the model does not"),
             ({"lora_name": "x", "lora_path": str(bad["other_base"])}, 400, "an adapter for another base model?"),
             ({"lora_name": "x", "lora_path": str(bad["corrupt"])}, 400, "is not a valid safetensors file"),
             ("{not json", 400, "Failed to parse the request body as JSON")]

    async def run():
        async with aiohttp.ClientSession() as s:
            answers = [await post(s, server.url + "/v1/load_lora_adapter", body) for body, _, _ in cases]
            async with s.get(server.url + "/api-doc/openapi.json") as r:
                document = await r.json()
            return answers, await generate_ids(s, server, "sql"), await get_models(s, server), document

    answers, sql, models, document = asyncio.run(run())
    contract = Contract(document)  # each refusal as the OpenAPI document describes the route's answers
    for (body, status, message), (got_status, got) in zip(cases, answers):
        assert got_status == status and message in got["error"]["message"], (body, got)
        contract.check("POST", "/v1/load_lora_adapter", got_status, "application/json", got)
        assert got["error"]["code"] is None and got["error"]["type"] in (
            "InvalidUserInput", "BadRequestError", "NotFoundError")
    assert sql == peft_greedy(model_dir, adapters["sql"], PROMPT, 12)
    assert "x" not in {m["id"] for m in models}


def test_metrics_count_a_loaded_adapters_requests(server, made):
    import re
    import urllib.request

    _, adapters = made

    def count() -> float:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
            m = re.search(r'^gaudi_serve_lora_requests_total{adapter="m"} (\S+)$', r.read().decode(), re.M)
        return float(m.group(1)) if m else 0.0

    async def run():
        async with aiohttp.ClientSession() as s:
            assert (await load(s, server, "m", adapters["code"]))[0] == 200
            await generate_ids(s, server, "m", n=2)
            await unload(s, server, "m")

    asyncio.run(run())
    assert count() == 1.0


def test_two_shards_start_without_adapters_and_load_each_ones_slice(made, tmp_path):
    """No adapter at start: every layer still has its slots; each shard writes its slice of a loaded
    adapter (column-parallel q/v, row-parallel o/down), and the tokens are peft's."""
    model_dir, adapters = made
    srv = launch(model_dir, tmp_path, "--device", "cpu", "--num-shard", "2", *SMALL_ARGS, "--model-name", "base",
                 "--max-lora-rank", "4", env={**SMALL_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    srv.model_dir = model_dir
    try:
        srv.wait_ready()

        async def run():
            async with aiohttp.ClientSession() as s:
                unknown = await v1_status(s, srv, "chat")
                answers = [await load(s, srv, name, adapters[name]) for name in ("chat", "code")]
                return unknown, answers, {name: await generate_ids(s, srv, name) for name in ("chat", "code")}

        unknown, answers, got = asyncio.run(run())
    finally:
        srv.stop()
    assert unknown[0] == 404  # with runtime updating `model` is checked even before any adapter is loaded
    assert [a[0] for a in answers] == [200, 200]
    for name, ids in got.items():
        assert ids == peft_greedy(model_dir, adapters[name], PROMPT, 12), name


async def test_the_endpoints_are_absent_without_the_opt_in(make_server):
    s = make_server()
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            async with session.post(s.url + path, json={"lora_name": "a", "lora_path": "/x"}) as r:
                assert r.status == 404
