"""Multi-LoRA serving (`--lora-adapters`, `--lora-modules`) as users run it.

* greedy tokens with an adapter equal transformers + peft (the adapter applied) token for token, for
  llama, mistral and qwen2 shapes, on 1 and 2 shards, prefix caching on;
* a mixed batch (the base model and three adapters, concurrently, more requests than
  --max-batch-size) gives each request what it gives alone; a prompt repeated under two adapters
  never reads the other's KV blocks, while repeats under one adapter hit the prefix cache;
* one device slot (--max-loras 1) serves three adapters, swapped in from a host cache of two
  (--max-cpu-loras 2, least recently used dropped, the others read again), one after another and
  all at once (a request for an adapter in no slot waits for one no running request uses);
* real clients: `openai` selecting by `model`, huggingface_hub's InferenceClient by `adapter_id`
  (text-generation 0.7.0, the latest on PyPI, has no adapter_id);
* an unknown adapter: 422 in TGI's shape on /generate, OpenAI's 404 model_not_found on /v1; the
  server goes on serving; /v1/models and /info list the adapters; every answer checked against the
  OpenAPI document.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.conformance import Contract
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, get_json, launch
from tests.runtime.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.slow

# (family, shards); the 2-shard case splits every adapter's A or B as its layer's weight.
CASES = [("llama", 1), ("mistral", 1), ("qwen2", 1), ("llama", 2)]
# Three adapters unlike one another: every projection; attention only, rank 2; MLP and o_proj, rsLoRA.
ADAPTERS = {"sql": dict(seed=1, rank=4), "chat": dict(seed=2, rank=2, targets=["q_proj", "k_proj", "v_proj"]),
            "code": dict(seed=3, rank=8, targets=["o_proj", "gate_proj", "up_proj", "down_proj"], rslora=True)}
PROMPTS = ["What is deep learning?", "kubernetes pod operator cluster node graph warmup bucket prefill decode",
           "serve request stream answer question data train weight layer", "a", "shard router"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            model_dir = make_tiny_model(tmp_path_factory.mktemp(family), family)
            cache[family] = model_dir, {name: make_adapter(model_dir, tmp_path_factory.mktemp(f"{family}-{name}"), **kw)
                                        for name, kw in ADAPTERS.items()}
        return cache[family]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{n}shards" for f, n in CASES])
def server(request, made, tmp_path_factory):
    family, shards = request.param
    model_dir, adapters = made(family)
    # TGI's and vLLM's spellings together: one adapter by --lora-adapters, two by --lora-modules.
    srv = launch(model_dir, tmp_path_factory.mktemp(f"lora-{family}-{shards}"), "--device", "cpu",
                 "--num-shard", str(shards), "--model-name", "base", *SMALL_ARGS,
                 "--lora-adapters", f"sql={adapters['sql']}",
                 "--lora-modules", f"chat={adapters['chat']}", f"code={adapters['code']}", env=SMALL_ENV)
    try:
        srv.wait_ready()
        srv.model_dir, srv.adapters = model_dir, adapters
        yield srv
    finally:
        srv.stop()


def reference(server, adapter: str | None, prompt: str, n: int) -> list[int]:
    return peft_greedy(server.model_dir, None if adapter is None else server.adapters[adapter], prompt, n)


async def generate_ids(session, url: str, prompt: str, n: int, adapter: str | None) -> list[int]:
    params = {"max_new_tokens": n, "details": True, **({"adapter_id": adapter} if adapter else {})}
    async with session.post(url + "/generate", json={"inputs": prompt, "parameters": params}) as r:
        assert r.status == 200, await r.text()
        return [t["id"] for t in (await r.json())["details"]["tokens"]]


async def stream_ids(session, url: str, prompt: str, n: int, adapter: str | None) -> list[int]:
    params = {"max_new_tokens": n, **({"adapter_id": adapter} if adapter else {})}
    ids = []
    async with session.post(url + "/generate_stream", json={"inputs": prompt, "parameters": params}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:"):
                ids.append(__import__("json").loads(line[5:])["token"]["id"])
    return ids


def test_each_adapter_gives_peft_greedy_tokens(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            return {(a, p): await generate_ids(s, server.url, p, 16, a)
                    for a in (None, *ADAPTERS) for p in PROMPTS[:2]}

    got = asyncio.run(run())
    for (adapter, prompt), ids in got.items():
        assert ids == reference(server, adapter, prompt, 16), (adapter, prompt)
    # The adapters do change the output: otherwise this test would prove nothing.
    for prompt in PROMPTS[:2]:
        assert len({tuple(got[a, prompt]) for a in (None, *ADAPTERS)}) == 4, prompt


def test_a_mixed_batch_gives_each_request_what_it_gives_alone(server):
    """Base and three adapters at once, 16 requests (--max-batch-size 8), streamed and not."""
    rng = random.Random(5)
    jobs = [(rng.choice([None, *ADAPTERS]), rng.choice(PROMPTS), rng.randint(4, 20), i % 2) for i in range(16)]

    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[(stream_ids if streamed else generate_ids)(s, server.url, p, n, a)
                                          for a, p, n, streamed in jobs])

    for (adapter, prompt, n, _), ids in zip(jobs, asyncio.run(run())):
        assert ids == reference(server, adapter, prompt, n), (adapter, prompt, n)
    code, info = get_json(server.url + "/info")
    assert info["kv_blocks_free"] == info["kv_blocks"]


def test_prefix_cache_is_per_adapter(server):
    """One long prompt, repeated under two adapters in turn: each repeat hits the blocks its own
    adapter left (hits grow) and still gives its own adapter's tokens."""
    prompt = " ".join(PROMPTS * 2)

    async def run():
        async with aiohttp.ClientSession() as s:
            return [await generate_ids(s, server.url, prompt, 8, a) for a in ("sql", "chat", "sql", "chat", None)]

    _, before = get_json(server.url + "/info")
    got = asyncio.run(run())
    _, after = get_json(server.url + "/info")
    for adapter, ids in zip(("sql", "chat", "sql", "chat", None), got):
        assert ids == reference(server, adapter, prompt, 8), adapter
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_unknown_adapters_are_refused_and_the_server_goes_on(server):
    async def run():
        contract = Contract((await _get(server.url + "/api-doc/openapi.json"))[1])
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", json={"inputs": "a", "parameters": {"adapter_id": "nope"}}) as r:
                tgi = r.status, await r.json()
            contract.check("POST", "/generate", tgi[0], "application/json", tgi[1])
            body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                oai = r.status, await r.json()
            contract.check("POST", "/v1/chat/completions", oai[0], "application/json", oai[1])
            models = await _get(server.url + "/v1/models")
            contract.check("GET", "/v1/models", 200, "application/json", models[1])
            info = await _get(server.url + "/info")
            contract.check("GET", "/info", 200, "application/json", info[1])
            return tgi, oai, models[1], info[1], await generate_ids(s, server.url, "a", 4, "code")

    tgi, oai, models, info, after = asyncio.run(run())
    assert tgi[0] == 422 and tgi[1]["error_type"] == "validation" and "nope" in tgi[1]["error"]
    assert oai == (404, {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": "model_not_found"}})
    cards = {m["id"]: m for m in models["data"]}
    assert cards["base"]["parent"] is None and cards["base"]["root"] == str(server.model_dir)
    for name in ADAPTERS:
        assert cards[name]["parent"] == "base" and cards[name]["root"] == str(server.adapters[name])
    assert info["lora_adapters"] == ["sql", "chat", "code"] and info["max_loras"] == 3
    assert after == reference(server, "code", "a", 4)


def test_real_clients_select_adapters(server):
    from huggingface_hub import InferenceClient
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    prompt = PROMPTS[0]
    for model, adapter in (("chat", "chat"), ("base", None), (str(server.model_dir), None)):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert r.model == (adapter or "base")
        assert r.usage.completion_tokens == 6
        hub = InferenceClient(model=server.url, timeout=60)
        text = hub.text_generation(prompt, max_new_tokens=6, adapter_id=adapter, details=True)
        assert [t.id for t in text.details.tokens] == reference(server, adapter, prompt, 6)
        assert r.choices[0].text == text.generated_text
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return r.status, await r.json()


def slot_writes(url: str) -> dict[str, float]:
    """gaudi_serve_lora_slot_writes_total by source: adapters written from the shards' host copies or read."""
    import re
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {source: float(m.group(1)) if (m := re.search(
        rf'^gaudi_serve_lora_slot_writes_total{{source="{source}"}} (\S+)$', text, re.M)) else 0.0
        for source in ("host_copy", "read")}


def test_one_device_slot_swaps_three_adapters_through_a_host_cache_of_two(made, tmp_path):
    """--max-loras 1 --max-cpu-loras 2, three adapters: requests alternating between them, then all at
    once, each give peft's tokens; the host cache keeps the two most recently used adapters (hits), the
    third is read from its files again. A fourth adapter whose files went away after the start fails its
    request with the reason, and the others go on."""
    import shutil

    model_dir, adapters = made("llama")
    gone = tmp_path / "gone"
    shutil.copytree(adapters["sql"], gone)
    srv = launch(model_dir, tmp_path, "--device", "cpu", *SMALL_ARGS, "--max-loras", "1", "--max-cpu-loras", "2",
                 "--lora-adapters", ",".join(f"{n}={p}" for n, p in {**adapters, "gone": gone}.items()), env=SMALL_ENV)
    srv.model_dir, srv.adapters = model_dir, adapters
    # sql starts in the slot and chat/sql in host memory; code's read drops sql (least recently used).
    alternating = ["sql", "chat", "code", "chat", "code", "chat", "sql"]
    jobs = [(a, p) for a in (*ADAPTERS, None) for p in PROMPTS[:2]]
    try:
        srv.wait_ready()

        async def run():
            async with aiohttp.ClientSession() as s:
                one_by_one = [await generate_ids(s, srv.url, PROMPTS[0], 8, a) for a in alternating]
                writes = slot_writes(srv.url)
                together = await asyncio.gather(*[stream_ids(s, srv.url, p, 10, a) for a, p in jobs])
                shutil.rmtree(gone)
                body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4, "adapter_id": "gone"}}
                async with s.post(srv.url + "/generate", json=body) as r:
                    failed = r.status, await r.json()
                return one_by_one, writes, together, failed, await generate_ids(s, srv.url, PROMPTS[0], 8, "code")

        one_by_one, writes, together, failed, after = asyncio.run(run())
        info = get_json(srv.url + "/info")[1]
    finally:
        srv.stop()
    for adapter, ids in zip(alternating, one_by_one):
        assert ids == reference(srv, adapter, PROMPTS[0], 8), adapter
    assert writes == {"host_copy": 4, "read": 2}  # chat, code, chat, code from memory; code, then sql, read
    for (adapter, prompt), ids in zip(jobs, together):
        assert ids == reference(srv, adapter, prompt, 10), (adapter, prompt)
    assert failed[0] >= 400 and "the LoRA adapter 'gone' could not be loaded" in failed[1]["error"], failed
    assert after == reference(srv, "code", PROMPTS[0], 8)
    assert (info["lora_adapters"], info["max_loras"], info["max_cpu_loras"]) == ([*ADAPTERS, "gone"], 1, 2)


@pytest.mark.parametrize("bad, message", [("rank", "above --max-lora-rank 2"), ("dir", "is no directory")])
def test_a_bad_adapter_stops_the_start_with_its_reason(made, tmp_path, bad, message):
    model_dir, adapters = made("llama")
    path = adapters["sql"] if bad == "rank" else str(tmp_path / "absent")
    srv = launch(model_dir, tmp_path, "--device", "cpu", *SMALL_ARGS, "--max-lora-rank", "2",
                 "--lora-adapters", f"sql={path}", env=SMALL_ENV)
    try:
        assert srv.proc.wait(timeout=120) == 2
        assert message in srv.log() and "sql" in srv.log()
    finally:
        srv.stop()


def test_a_hub_adapter_is_downloaded_into_the_hub_cache_at_its_revision(made, tmp_path):
    """`--lora-adapters org/sql@main`: fetched from the hub (a stand-in) as the model would be, served
    under its hub id, and the same tokens as peft on the local copy."""
    import os

    from tests.hub_standin import HubStandIn, StandInRepo

    model_dir, adapters = made("llama")
    files = {f.name: f.read_bytes() for f in adapters["sql"].iterdir() if f.is_file()}
    hub = HubStandIn({"org/sql": StandInRepo(files)}).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(SMALL_ENV, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HUGGINGFACE_HUB_CACHE=str(tmp_path / "cache"))
    srv = launch(model_dir, tmp_path, "--device", "cpu", *SMALL_ARGS, "--lora-adapters", "org/sql@main", env=env)
    srv.model_dir, srv.adapters = model_dir, {"org/sql": adapters["sql"]}
    try:
        srv.wait_ready()

        async def run():
            async with aiohttp.ClientSession() as s:
                return await generate_ids(s, srv.url, PROMPTS[0], 8, "org/sql")

        assert asyncio.run(run()) == reference(srv, "org/sql", PROMPTS[0], 8)
    finally:
        srv.stop()
        hub.stop()
    snapshots = list((tmp_path / "cache" / "models--org--sql" / "snapshots").iterdir())
    assert len(snapshots) == 1 and {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in snapshots[0].iterdir()}


def test_metrics_name_the_adapters_running_and_count_their_requests(server):
    """While a stream with adapter `code` runs, vllm:lora_requests_info has a series naming it running,
    stamped with the time; gaudi_serve_lora_requests_total counts each adapter's sequences."""
    import re
    import time
    import urllib.request

    def metrics() -> str:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def count(text: str, adapter: str) -> float:
        m = re.search(rf'^gaudi_serve_lora_requests_total{{adapter="{adapter}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = metrics()

    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"inputs": "a", "parameters": {"max_new_tokens": 100, "ignore_eos": True, "adapter_id": "code"}}
            task = asyncio.create_task(s.post(server.url + "/generate", json=body))
            deadline, seen, text = time.monotonic() + 60, None, ""
            while seen is None and time.monotonic() < deadline and not task.done():
                text = await asyncio.to_thread(metrics)
                seen = re.search(r'^vllm:lora_requests_info{(?=[^}]*max_lora="3")(?=[^}]*running_lora_adapters="code")'
                                 r'[^}]*} (\S+)$', text, re.M)
                await asyncio.sleep(0.05)  # poll interval of a deadline-bounded wait
            async with await task as r:
                assert r.status == 200
            return seen, text

    started = time.time()
    seen, text = asyncio.run(run())
    assert seen is not None, [line for line in text.splitlines() if "lora" in line]
    assert abs(float(seen.group(1)) - started) < 60
    assert count(metrics(), "code") == count(before, "code") + 1


def test_adapters_with_chunked_prompts_and_speculation_give_peft_tokens(made, tmp_path):
    """Prompts longer than the prefill budget (chunks between decode steps) and n-gram drafts verified
    per adapter row: still transformers + peft's greedy tokens, adapter rows mixed with base rows."""
    model_dir, adapters = made("llama")
    srv = launch(model_dir, tmp_path, "--device", "cpu", "--model-name", "base", *SMALL_ARGS,
                 "--max-batch-prefill-tokens", "16", "--speculate", "3",
                 "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()), env=SMALL_ENV)
    prompts = [PROMPTS[1] + " " + PROMPTS[1], "the cat the cat the cat the cat the cat the cat the cat the cat"]
    try:
        srv.wait_ready()

        async def run():
            async with aiohttp.ClientSession() as s:
                jobs = [(a, p) for a in (None, *ADAPTERS) for p in prompts]
                got = await asyncio.gather(*(generate_ids(s, srv.url, p, 24, a) for a, p in jobs))
                return dict(zip(jobs, got))

        for (adapter, prompt), ids in asyncio.run(run()).items():
            assert ids == peft_greedy(model_dir, None if adapter is None else adapters[adapter], prompt, 24), adapter
        info = get_json(srv.url + "/info")[1]
        assert info["prefill_chunks"] > 0 and info["speculate"] == 3
    finally:
        srv.stop()
