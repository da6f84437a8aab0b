"""Warmup as the operator of a Gaudi pod relies on it: every bucket compiled once before serving,
graphs replayed (never captured) while serving, out-of-memory named, nothing unwarmed at run time."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import aiohttp
import pytest
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import resolve
from gaudi_runtime.device.base import Backend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.runner import ModelRunner, PrefillInput, WarmupError
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, launch

SMALL = {"DTYPE": "float32", "MAX_INPUT_TOKENS": "48", "MAX_TOTAL_TOKENS": "96", "MAX_BATCH_SIZE": "8",
         "MAX_BATCH_PREFILL_TOKENS": "96", "BLOCK_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
         "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def config(model_dir, **kw):
    return resolve(None, {"MODEL_ID": str(model_dir), **SMALL, **{k: str(v) for k, v in kw.items()}})


def serve_some(runner: ModelRunner, steps: int = 6) -> None:
    rng = random.Random(0)
    reqs = [PrefillInput(i, [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))], SamplingParameters(), 0,
                         list(range(1 + 30 * i, 1 + 30 * (i + 1))), False) for i in range(3)]
    runner.prefill(1, reqs[:2])
    runner.prefill(2, reqs[2:])
    batch_id, _ = runner.decode([(1, [0, 1]), (2, [2])])
    for _ in range(steps):
        batch_id, _ = runner.decode([(batch_id, [0, 1, 2])])


def test_hpu_backend_is_chosen_when_habana_frameworks_imports(fake_hpu, monkeypatch):
    from gaudi_runtime.device import select_device

    monkeypatch.delenv("PT_HPU_ENABLE_LAZY_COLLECTIVES", raising=False)
    assert select_device("auto").name == "hpu"
    b = select_device("auto", world_size=8)
    assert b.distributed_backend == "hccl"
    import os

    assert os.environ["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    assert b.memory_info() == (7 << 30, 8 << 30)


def test_hpu_graphs_capture_each_bucket_once_and_only_replay_while_serving(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir)
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    progress = list(runner.warmup())
    total = sum(len(shapes) for shapes in (buckets.prefill_buckets(cfg), buckets.prefill_context_buckets(cfg),
                                           buckets.decode_flat_buckets(cfg)))  # HPU decodes over flat blocks
    assert progress[-1] == (total, total, "done")
    # The count the operator shows (gaudi_operator/estimate.py) is the one the shards warm up.
    assert total == buckets.warmup_shape_count(cfg, cfg.replace(device="hpu").device.decodes_flat)
    captured = fake_hpu["captures"]
    assert len(captured) == total == len(set(captured))  # one capture per bucket
    assert {k[0] for k in captured} == {"prefill", "prefill_context", "decode"}
    steps_after_warmup = fake_hpu["mark_step"]
    assert steps_after_warmup >= total

    serve_some(runner)
    assert len(fake_hpu["captures"]) == total  # serving captured nothing new
    assert len(fake_hpu["replays"]) == 2 + 1 + 6
    assert fake_hpu["mark_step"] > steps_after_warmup
    assert runner.unwarmed_shapes == 0


def test_every_pass_on_a_shape_warmup_missed_is_counted(model_dir):
    runner = ModelRunner(config(model_dir), str(model_dir), Backend(torch.device("cpu")))
    list(runner.warmup())
    runner.warmed = {k for k in runner.warmed if k[0] != "decode"}
    serve_some(runner, 3)
    assert runner.unwarmed_shapes == 4  # every decode pass (1 merged + 3) ran on an unwarmed shape


def test_limit_hpu_graph_keeps_prefill_out_of_graphs(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir, LIMIT_HPU_GRAPH="true")
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    list(runner.warmup())
    assert {k[0] for k in fake_hpu["captures"]} == {"decode"}
    assert len(fake_hpu["captures"]) == len(buckets.decode_flat_buckets(cfg))


def test_graphs_off_means_no_wrapping(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir, ENABLE_HPU_GRAPH="false")
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(graphs=False, torch_device=torch.device("cpu")))
    list(runner.warmup())
    serve_some(runner, 2)
    assert fake_hpu["wrapped"] == 0 and fake_hpu["captures"] == []


def test_warmup_out_of_memory_names_the_setting_to_lower(model_dir):
    class SmallDevice(Backend):
        def graphed(self, fn, name):
            def run(*args):
                if name == "decode" and args[0].shape[0] >= 8:
                    raise torch.OutOfMemoryError("device full")
                return fn(*args)
            return run

    runner = ModelRunner(config(model_dir), str(model_dir), SmallDevice(torch.device("cpu")))
    with pytest.raises(WarmupError, match="--max-batch-size"):
        list(runner.warmup())


def test_exponential_bucketing_cuts_the_bucket_count():
    env = {"MODEL_ID": "/m", "MAX_INPUT_TOKENS": "4096", "MAX_TOTAL_TOKENS": "8192", "MAX_BATCH_SIZE": "64",
           "MAX_BATCH_PREFILL_TOKENS": "8192"}
    linear = resolve(None, env)
    exp = resolve(None, {**env, "EXPONENTIAL_BUCKETING": "true"})
    assert len(buckets.decode_buckets(exp)) * 4 < len(buckets.decode_buckets(linear))
    assert len(buckets.prefill_buckets(exp)) < len(buckets.prefill_buckets(linear))
    assert buckets.prefill_seq_bucket(129, exp) == 256
    assert buckets.prefill_seq_bucket(600, exp) == 1024
    assert buckets.prefill_seq_bucket(4000, exp) == 4096
    # every reachable shape is still warmed
    dec = set(buckets.decode_buckets(exp))
    for n in range(1, 65, 3):
        for ctx in range(1, 8193, 97):
            assert (buckets.decode_batch_bucket(n, exp), buckets.decode_block_bucket(ctx, exp)) in dec


@pytest.mark.parametrize("exponential", ["false", "true"])
def test_random_traffic_never_runs_an_unwarmed_shape(model_dir, tmp_path, exponential):
    srv = launch(model_dir, tmp_path, "--dtype", "float32", "--max-input-tokens", "60", "--max-total-tokens", "120",
                 "--max-batch-size", "12", "--max-batch-prefill-tokens", "160", "--block-size", "4",
                 env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2",
                      "EXPONENTIAL_BUCKETING": exponential})
    rng = random.Random(3 if exponential == "true" else 4)
    words = "the a gaudi card shard router token batch cache serve request 東京 😀".split()

    async def one(s, i):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        body = {"inputs": prompt, "parameters": {"max_new_tokens": rng.randint(1, 50), "truncate": 60}}
        async with s.post(srv.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()

    async def run():
        async with aiohttp.ClientSession() as s:
            for wave in range(3):
                await asyncio.gather(*(one(s, wave * 20 + i) for i in range(20)))

    try:
        srv.wait_ready()
        asyncio.run(run())
        _, info = get_json(srv.url + "/info")
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    finally:
        srv.stop()
    assert info["unwarmed_shapes"] == 0
    assert "gaudi_serve_unwarmed_shapes_total 0.0" in metrics
    assert info["warmup"]["prefill_shapes"] > 0 and info["warmup"]["decode_shapes"] > 0
    assert info["kv_blocks_free"] == info["kv_blocks"]


def test_grammar_masks_on_hpu_are_bucket_shaped_and_filled_while_the_step_runs(fake_hpu, model_dir):
    """A batch with grammars replays the warmed graphs (nothing captured); each step's token mask has
    the bucket's rows, one fixed device buffer per bucket, and is filled and uploaded after the
    forward pass was launched (mark_step) and before the sampler runs."""
    import json

    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.shard.grammar import bitmask_words

    cfg = config(model_dir)
    backend = HpuBackend(torch_device=torch.device("cpu"))
    runner = ModelRunner(cfg, str(model_dir), backend)
    list(runner.warmup())
    captured = len(fake_hpu["captures"])
    uploads = []
    upload = backend.upload

    def recorded_upload(host):
        fake_hpu["events"].append(("upload", tuple(host.shape)))
        out = upload(host)
        uploads.append(out)
        return out

    backend.upload = recorded_upload
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]})
    runner.grammars.compile(7, "json", schema)  # CompileGrammar's work: the prefills name id 7
    reqs = [PrefillInput(i, [5, 6, 7], SamplingParameters(do_sample=True, seed=i), 0,
                         list(range(1 + 30 * i, 1 + 30 * (i + 1))), False,
                         grammar=7 if i != 1 else None) for i in range(3)]
    runner.prefill(1, reqs)
    fake_hpu["events"].clear()
    batch_id, _ = runner.decode([(1, [0, 1, 2])])
    rows = buckets.decode_batch_bucket(3, cfg)
    assert fake_hpu["events"] == [("graph", "decode"), "mark_step", ("upload", (rows, bitmask_words(runner.model.vocab_size))),
                                  "mark_step"]
    for _ in range(4):
        batch_id, _ = runner.decode([(batch_id, [0, 1, 2])])
    assert len(fake_hpu["captures"]) == captured
    assert len({id(u) for u in uploads}) == 1  # the same device buffer every step of the bucket


async def serve_in_process(runner: ModelRunner, cfg, model_dir, sock: str, traffic) -> dict:
    """The router's engine over one shard served in this process (real gRPC on a unix socket), running
    `traffic(engine)`; returns the engine's /info fields."""
    import grpc

    from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
    from gaudi_runtime.router.client import ShardClient
    from gaudi_runtime.router.engine import BatchingEngine
    from gaudi_runtime.router.tokenizer import RouterTokenizer
    from gaudi_runtime.shard.servicer import ShardServicer

    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServiceServicer_to_server(ShardServicer(runner, 0, 1), server)
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    engine = BatchingEngine(cfg, ShardClient([sock]), RouterTokenizer.load(str(model_dir), cfg.model))
    try:
        await engine.start(connect_timeout_s=30)
        await traffic(engine)
        return engine.info()
    finally:
        await engine.stop()
        await server.stop(grace=None)


def conversation_traffic(rng: random.Random, conversations: int, turns: int, max_input: int):
    """Random conversations behind one system prompt, each turn resending the whole history, several
    conversations at once: prefills with and without cached blocks, of every size, joining decodes."""
    from gaudi_runtime.router.types import StoppingParameters, ValidRequest

    system = [rng.randrange(3, 400) for _ in range(rng.randint(4, 20))]

    async def converse(engine, seed: int):
        crng, history = random.Random(seed), list(system)
        for _ in range(turns):
            history = (history + [crng.randrange(3, 400) for _ in range(crng.randint(1, 12))])[-max_input:]
            req = ValidRequest(input_ids=list(history), inputs="", sampling=SamplingParameters(),
                               stopping=StoppingParameters(max_new_tokens=crng.randint(1, 12)))
            history += [ev.token.id async for ev in engine.generate(req)]

    async def traffic(engine):
        await asyncio.gather(*(converse(engine, rng.randrange(1 << 30)) for _ in range(conversations)))

    return traffic


@pytest.mark.parametrize("exponential", ["false", "true"])
def test_multi_turn_traffic_with_prefix_caching_runs_only_warmed_graphs(fake_hpu, model_dir, tmp_path, exponential):
    """On Gaudi, a prefill whose prompts start with cached blocks has shapes of its own (new tokens x
    cached blocks): warmup compiles them all, and conversations that hit the cache compile nothing new."""
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir, EXPONENTIAL_BUCKETING=exponential, MAX_BATCH_TOTAL_TOKENS="400")
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    traffic = conversation_traffic(random.Random(11), conversations=6, turns=4, max_input=cfg.limits.max_input_tokens)
    info = asyncio.run(serve_in_process(runner, cfg, model_dir, str(tmp_path / "shard"), traffic))
    warmed = len(buckets.prefill_buckets(cfg)) + len(buckets.prefill_context_buckets(cfg)) + len(
        buckets.decode_flat_buckets(cfg))
    assert len(fake_hpu["captures"]) == warmed  # serving captured (compiled) nothing
    assert {k[0] for k in fake_hpu["replays"]} == {"prefill", "prefill_context", "decode"}
    assert info["unwarmed_shapes"] == 0 and runner.unwarmed_shapes == 0
    assert info["prefix_cache_hits"] > 0
    assert info["kv_blocks_free"] == info["kv_blocks"]
