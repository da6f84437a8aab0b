"""Tensor-parallel serving (`--num-shard N`, gloo on CPU) as users run it.

* `gaudi-serve launch --num-shard 2` (and 4 for a model whose 2 KV heads are fewer than the shards,
  its vocabulary of 490 padded to 492) gives transformers' greedy tokens (= the 1-shard output),
  alone and for concurrent requests joining a running batch, for every supported family;
* seeded sampling gives the same tokens with N shards as one shard (an in-process 1-shard runner);
* each of 2 ranks holds at most ~55% of the 1-shard weight bytes;
* a killed shard or a hung shard stops every process with a non-zero exit and `/health` fails first;
  a rank that cannot join the process group exits with a clear message instead of hanging;
* `--num-shard` defaults to every visible card (TGI), `--sharded false` forces one;
* with a host KV tier (`--kv-offloading-size`) each rank copies its own slice out and back: a prompt
  evicted from the device comes back from host memory with the 1-shard output.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch

from gaudi_runtime.config import ConfigError, resolve
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import (
    SMALL_ARGS,
    SMALL_ENV,
    alive,
    children,
    free_port,
    get_json,
    greedy_reference,
    launch,
    stream_ids,
)
from tests.runtime.prefix_checks import check_conversations

FAMILIES = ["llama", "llama31", "mistral", "qwen2"]
# qwen2 at 4 shards: 2 KV heads each replicated on 2 ranks (with q/k/v biases), tied embeddings, vocab
# 490 padded to 492.
CASES = [(f, 2) for f in FAMILIES] + [("qwen2", 4)]

# --device cpu: gloo on CPU whatever accelerator the test machine has (what CI shows). A KV budget of
# 128 blocks of 4 tokens and a host tier under it.
SERVER_ARGS = ["--device", "cpu", *SMALL_ARGS, "--max-batch-total-tokens", "512", "--kv-offloading-size", "0.001"]

PROMPTS = [
    "What is deep learning?",
    "kubernetes pod operator cluster node graph warmup bucket prefill decode hello world the a deep",
    "東京 数据",
    "a",
    "serve request stream answer question data train weight layer",
    "café naïve über",
    "shard router",
    "😀 🚀 model",
]

SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{n}shards" for f, n in CASES])
def server(request, model_dirs, tmp_path_factory):
    family, shards = request.param
    model_dir = model_dirs(family)
    srv = launch(model_dir, tmp_path_factory.mktemp(f"{family}-{shards}"), "--num-shard", str(shards),
                 *SERVER_ARGS, env=SMALL_ENV)
    try:
        srv.wait_ready()
        srv.model_dir, srv.shards = model_dir, shards
        yield srv
    finally:
        srv.stop()


reference = greedy_reference


async def generate(session, url, prompt, max_new_tokens, **params) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **params}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["details"]


def test_info_reports_the_shards(server):
    code, info = get_json(server.url + "/info")
    assert code == 200
    assert info["num_shard"] == server.shards
    assert info["weight_bytes_per_shard"] > 0


def test_greedy_single_requests_match_one_shard(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            return [await generate(s, server.url, p, 24) for p in PROMPTS[:3]]

    for prompt, details in zip(PROMPTS[:3], asyncio.run(run())):
        assert [t["id"] for t in details["tokens"]] == reference(server.model_dir, prompt, 24), prompt


def test_greedy_concurrent_requests_match_one_shard(server):
    """Requests join a running batch one by one (streaming), then a burst arrives at once."""
    rng = random.Random(3)
    lengths = [rng.randint(4, 32) for _ in PROMPTS]

    async def run():
        async with aiohttp.ClientSession() as s:
            staggered = []
            for prompt, n in list(zip(PROMPTS, lengths))[:4]:
                started = asyncio.Event()
                staggered.append(asyncio.create_task(stream_ids(s, server.url, prompt, n, started)))
                await started.wait()
            burst = [asyncio.create_task(generate(s, server.url, p, n)) for p, n in zip(PROMPTS, lengths)]
            return await asyncio.gather(*staggered), await asyncio.gather(*burst)

    staggered, burst = asyncio.run(run())
    for prompt, n, got in zip(PROMPTS, lengths, staggered):
        assert got == reference(server.model_dir, prompt, n), prompt
    for prompt, n, details in zip(PROMPTS, lengths, burst):
        assert [t["id"] for t in details["tokens"]] == reference(server.model_dir, prompt, n), prompt
    code, info = get_json(server.url + "/info")
    assert info["kv_blocks_free"] == info["kv_blocks"]


def test_conversations_with_cached_history_match_one_shard(server):
    """Every rank reads the same cached blocks: the prefill of the uncached tail agrees across ranks."""
    check_conversations(server, conversations=2, seed=server.shards)


def test_a_prompt_evicted_to_host_memory_comes_back_the_same_on_every_rank(server):
    """One prompt, then others enough to evict it from the device, then the first again: its blocks
    come back from each rank's host tier and the answer is still the 1-shard one."""
    rng = random.Random(server.shards)
    words = "the a gaudi card shard router token batch cache serve request stream answer".split()
    prompts = [f"{i} " + " ".join(rng.choice(words) for _ in range(50)) for i in range(16)]

    async def run():
        async with aiohttp.ClientSession() as s:
            return [await generate(s, server.url, p, 4 if i in (0, 16) else 1)
                    for i, p in enumerate(prompts + prompts[:1])]

    answers = asyncio.run(run())
    assert [t["id"] for t in answers[-1]["tokens"]] == reference(server.model_dir, prompts[0], 4)
    code, info = get_json(server.url + "/info")
    assert info["kv_offloading"]["hits_host"] > 0 and info["kv_offloading"]["bytes_host_to_device"] > 0


_RUNNERS: dict[str, object] = {}


def _one_shard_sampled(model_dir, input_ids: list[int], seed: int, max_new_tokens: int,
                       grammar: tuple[str, str] | None = None) -> list[int]:
    """The 1-shard shard path in process: the same ModelRunner and sampler `launch` runs on rank 0."""
    from gaudi_runtime.device.cpu import CpuBackend
    from gaudi_runtime.proto import generate_pb2 as pb
    from gaudi_runtime.shard.runner import ModelRunner, PrefillInput
    from gaudi_runtime.shard.servicer import to_params

    key = str(model_dir)
    if key not in _RUNNERS:
        cfg = resolve(None, {"MODEL_ID": str(model_dir), "DTYPE": "float32", "DEVICE": "cpu", "BLOCK_SIZE": "4",
                             "MAX_TOTAL_TOKENS": "128", "MAX_BATCH_SIZE": "8", "NUM_SHARD": "1"})
        _RUNNERS[key] = ModelRunner(cfg, str(model_dir), CpuBackend())
    runner = _RUNNERS[key]
    params = to_params(pb.NextTokenChooserParameters(seed=seed, **SAMPLING))
    blocks = list(range(1, 1 + (len(input_ids) + max_new_tokens + 3) // 4 + 1))
    grammar_id = None
    if grammar is not None:
        grammar_id = 1 + len(runner.grammars)
        runner.grammars.compile(grammar_id, *grammar)  # CompileGrammar's work: the prefill names the id
    step = runner.prefill(1, [PrefillInput(1, input_ids, params, 0, blocks, False, grammar=grammar_id)])
    out = step.sample.next_ids[:1].tolist()
    while len(out) < max_new_tokens:
        _, step = runner.decode([(1, [1])])
        out += step.sample.next_ids[:1].tolist()
    runner.clear(None)
    return out


def test_seeded_sampling_matches_one_shard(server):
    """Every rank samples the same token (seeded Gumbel noise over identical logits): N shards give the
    tokens of one shard, alone and for requests sampled together in one batch."""
    seeds = [11, 12, 13, 14]

    async def run():
        async with aiohttp.ClientSession() as s:
            alone = await generate(s, server.url, PROMPTS[0], 20, seed=seeds[0], decoder_input_details=True,
                                   **SAMPLING)
            together = await asyncio.gather(*(
                generate(s, server.url, p, 20, seed=seed, decoder_input_details=True, **SAMPLING)
                for p, seed in zip(PROMPTS[1:], seeds[1:])))
            return [alone, *together]

    results = asyncio.run(run())
    sampled = [[t["id"] for t in d["tokens"]] for d in results]
    greedy = [reference(server.model_dir, p, 20) for p in PROMPTS[:len(seeds)]]
    assert sum(s != g for s, g in zip(sampled, greedy)) >= 3  # it really sampled
    for seed, details in zip(seeds, results):
        got = [t["id"] for t in details["tokens"]]
        input_ids = [t["id"] for t in details["prefill"]]
        want = _one_shard_sampled(server.model_dir, input_ids, seed, 20)
        assert details["seed"] == seed
        # the server stops early at EOS; the in-process run does not
        assert got == want[:len(got)] and (len(got) == 20 or details["finish_reason"] == "eos_token"), seed


def test_constrained_sampling_is_the_same_on_every_rank(server):
    """With a grammar, every rank masks the same tokens and picks the same one: N shards give the
    tokens of one shard, and the output follows the grammar."""
    import re

    regex = "[a-z]{2,6}-[0-9]{2}"

    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(
                generate(s, server.url, p, 20, seed=seed, decoder_input_details=True,
                         grammar={"type": "regex", "value": regex}, **SAMPLING)
                for p, seed in zip(PROMPTS[:3], (21, 22, 23))))

    def text(details):
        return "".join(t["text"] for t in details["tokens"] if not t["special"])

    for seed, details in zip((21, 22, 23), asyncio.run(run())):
        got = [t["id"] for t in details["tokens"]]
        input_ids = [t["id"] for t in details["prefill"]]
        assert got == _one_shard_sampled(server.model_dir, input_ids, seed, 20, ("regex", regex))[:len(got)]
        assert details["finish_reason"] == "eos_token" and re.fullmatch(regex, text(details))


# ---- memory per rank ---------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _weights_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from gaudi_runtime.models import load_model
    from gaudi_runtime.shard.memory import weight_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        anon0 = _status_kib("RssAnon")
        model = load_model(model_dir, torch.bfloat16, torch.device("cpu"), tp_rank=rank, tp_size=world,
                           process_group=dist.group.WORLD)
        # Anonymous resident memory the load added (the safetensors file is mmapped: page cache, not counted).
        torch.save({"weight_bytes": weight_bytes(model), "rss_anon_growth_kib": _status_kib("RssAnon") - anon0},
                   f"{out_dir}/rank{rank}-of-{world}.pt")
    finally:
        dist.destroy_process_group()


def test_each_of_two_ranks_holds_at_most_55_percent_of_the_weights(tmp_path_factory, tmp_path):
    """Measured on a 26M-parameter model (8 layers, hidden 512), where replicated norms and rotary
    tables are a small part: what each rank holds once loaded, against one rank holding it all."""
    import torch.multiprocessing as mp

    from gaudi_runtime.models import load_model
    from gaudi_runtime.shard.memory import weight_bytes

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("small"), "llama", size="small", dtype="bfloat16"))
    for world in (1, 2):
        mp.spawn(_weights_worker, args=(world, free_port(), model_dir, str(tmp_path)), nprocs=world, join=True)
    one = torch.load(tmp_path / "rank0-of-1.pt")
    ranks = [torch.load(tmp_path / f"rank{r}-of-2.pt") for r in range(2)]
    full = one["weight_bytes"]
    per_rank = [r["weight_bytes"] for r in ranks]
    print(f"\nweight bytes: 1 shard {full}; 2 shards {per_rank} "
          f"({', '.join(f'{b / full:.1%}' for b in per_rank)}); anonymous RSS added by the load (KiB): "
          f"1 shard {one['rss_anon_growth_kib']}, 2 shards {[r['rss_anon_growth_kib'] for r in ranks]}")
    assert all(b <= 0.55 * full for b in per_rank), (full, per_rank)
    assert all(r["rss_anon_growth_kib"] <= 0.55 * one["rss_anon_growth_kib"] for r in ranks)
    assert full == weight_bytes(load_model(model_dir, torch.bfloat16, torch.device("cpu")))
    assert sum(per_rank) >= full  # nothing dropped: the halves (plus replicated norms) cover the model


# ---- failures --------------------------------------------------------------------------------------------


def _shards(kids: list[int]) -> dict[int, int]:
    """rank -> pid of the launcher's shard kids."""
    ranks = {}
    for pid in kids:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if b"shard" in args:
            ranks[int(args[args.index(b"--rank") + 1])] = pid
    return ranks


def _health(url: str) -> int | None:
    """/health's status code; None when nothing answers."""
    try:
        return get_json(url + "/health", timeout=2)[0]
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None


def _assert_all_gone(kids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval of a deadline-bounded wait
    assert not any(alive(p) for p in kids), [p for p in kids if alive(p)]


FAIL_ARGS = ["--device", "cpu", "--num-shard", "2", "--dtype", "float32", "--max-input-tokens", "32",
             "--max-total-tokens", "64", "--max-batch-size", "4"]
FAIL_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "4"}


def test_killing_one_of_two_shards_stops_everything_non_zero(model_dirs, tmp_path):
    srv = launch(model_dirs("llama"), tmp_path, *FAIL_ARGS, env=FAIL_ENV)
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        shards = _shards(kids)
        assert sorted(shards) == [0, 1] and len(kids) == 3, kids  # shard-0, shard-1 and the router
        killed = time.monotonic()
        os.kill(shards[1], signal.SIGKILL)
        while _health(srv.url) == 200 and time.monotonic() - killed < 30:
            time.sleep(0.05)  # poll interval of a deadline-bounded wait
        assert _health(srv.url) != 200
        code = srv.proc.wait(timeout=60)
        stopped_in = time.monotonic() - killed
        assert code != 0
        _assert_all_gone(kids)
        assert stopped_in < 30, stopped_in
        assert "shard-1 exited with code -9" in srv.log()
    finally:
        srv.stop()


def test_a_hung_shard_turns_health_503_then_stops_everything_non_zero(model_dirs, tmp_path):
    """Shard 1 stops answering (SIGSTOP): the router's call times out (GAUDI_SERVE_SHARD_TIMEOUT_S), the
    request gets an error, /health answers 503, the router exits non-zero and the launcher stops all."""
    srv = launch(model_dirs("llama"), tmp_path, *FAIL_ARGS,
                 env={**FAIL_ENV, "GAUDI_SERVE_SHARD_TIMEOUT_S": "3", "GAUDI_SERVE_FAIL_EXIT_DELAY_S": "4"})
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        shards = _shards(kids)
        os.kill(shards[1], signal.SIGSTOP)
        hung = time.monotonic()
        req = urllib.request.Request(srv.url + "/generate", data=json.dumps(
            {"inputs": "hello world", "parameters": {"max_new_tokens": 5}}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 424
        assert "DEADLINE_EXCEEDED" in json.loads(err.value.read())["error"]
        code, body = get_json(srv.url + "/health")
        assert code == 503 and body["status"] == "failed", body
        assert srv.proc.wait(timeout=60) != 0
        _assert_all_gone(kids)
        assert time.monotonic() - hung < 45
        assert "router exited with code 1" in srv.log()
    finally:
        srv.stop()  # SIGKILL after its grace reaches a stopped process too


def test_a_rank_that_cannot_join_exits_with_a_clear_message(model_dirs, tmp_path):
    """World size 2 with only rank 0 started: no hang, one line saying what could not be joined."""
    from gaudi_runtime.launcher import CONFIG_ENV, MODEL_DIR_ENV

    model_dir = str(model_dirs("llama"))
    cfg = resolve(None, {"MODEL_ID": model_dir, "DEVICE": "cpu", "DTYPE": "float32", "NUM_SHARD": "2",
                         "SHARD_UDS_PATH": str(tmp_path / "s")})
    env = dict(os.environ, **{CONFIG_ENV: cfg.to_json(), MODEL_DIR_ENV: model_dir, "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port()), "GAUDI_SERVE_JOIN_TIMEOUT_S": "3"})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gaudi_runtime.cli", "shard", "--rank", "0", "--world-size", "2"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 60
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("shard 0/2: could not join the gloo process group at 127.0.0.1:"), r.stderr
    assert "GAUDI_SERVE_JOIN_TIMEOUT_S" in last
    assert not os.path.exists(f"{cfg.server.shard_uds_path}-0")  # it never served


# ---- defaults --------------------------------------------------------------------------------------------


def test_num_shard_defaults_to_every_visible_card():
    base = {"MODEL_ID": "/m"}
    four = lambda device: 4  # noqa: E731
    cfg = resolve(None, base, device_count=four)
    assert (cfg.device.num_shard, cfg.device.sharded) == (4, True)
    assert resolve(None, {**base, "SHARDED": "true"}, device_count=four).device.num_shard == 4
    assert resolve(None, {**base, "SHARDED": "false"}, device_count=four).device.num_shard == 1
    assert resolve(None, {**base, "NUM_SHARD": "2"}, device_count=four).device.num_shard == 2
    cfg = resolve(None, base, device_count=lambda device: 1)
    assert (cfg.device.num_shard, cfg.device.sharded) == (1, False)
    with pytest.raises(ConfigError, match="--sharded true"):
        resolve(None, {**base, "SHARDED": "true"}, device_count=lambda device: 1)


def test_visible_devices(monkeypatch):
    from gaudi_runtime.device import hpu, visible_device_count

    assert visible_device_count("cpu") == 1
    assert resolve(None, {"MODEL_ID": "/m", "DEVICE": "cpu"}).device.num_shard == 1
    monkeypatch.setenv("HABANA_VISIBLE_DEVICES", "0,1,2,3")
    assert hpu.device_count() == 4
    assert visible_device_count("hpu") == 4


def test_cpu_threads_are_split_between_shards():
    from gaudi_runtime.shard.server import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1, {}) == cores
    assert cpu_threads(2, {}) == max(1, cores // 2)
    assert cpu_threads(cores * 4, {}) == 1
    assert cpu_threads(2, {"OMP_NUM_THREADS": "3"}) is None
