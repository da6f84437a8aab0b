"""N-gram speculation (--speculate) as a user meets it: the same answers as plain decoding, token for
token, whether greedy (transformers' tokens) or seeded sampling (the plain server's tokens), with stop
sequences, grammars, streaming and prefix caching, on 1 and 2 shards; drafts that are accepted (vLLM's
counters say how many); and on Gaudi, speculative steps that run only warmed graphs."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import aiohttp
import pytest
import torch
import transformers
from text_generation import Client

from gaudi_runtime import buckets
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, greedy_reference, serve_small
from tests.runtime.prefix_checks import check_conversations, generate
from tests.runtime.test_warmup import config, serve_in_process

pytestmark = pytest.mark.slow

# Text that repeats itself: the tiny random model's greedy answers to it loop, which the drafts predict.
PROMPTS = ["the cat the cat the cat the cat", "a b c d e f a b c d e f a b", "hello world",
           "gaudi card shard gaudi card shard gaudi", "one two one two one two", "x y z x y z x y z x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """A server speculating 3 tokens a step and one that does not, on the same model."""
    tmp = tmp_path_factory.mktemp("speculation")
    plain = serve_small(model_dir, tmp)
    try:
        spec = serve_small(model_dir, tmp, "--speculate", "3")
    except BaseException:
        plain.stop()
        raise
    yield spec, plain
    spec.stop()
    plain.stop()


def spec_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "per_pos" not in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def run_all(url: str, jobs: list[tuple[str, int, dict]]) -> list[tuple[list[int], str]]:
    """The requests at once (more than a speculative step's rows when there are many)."""
    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(generate(s, url, p, n, **kw) for p, n, kw in jobs))
    return asyncio.run(run())


def test_greedy_answers_are_transformers_tokens_and_drafts_are_accepted(servers, model_dir):
    spec, _ = servers
    before = spec_counters(spec.url)
    # One at a time (each step of a request alone drafts when its text repeats: the counters below are
    # then the same every run); then rows that may draft, and more rows than a speculative step takes.
    batches = [[p] for p in PROMPTS[:3]] + [PROMPTS[:3], PROMPTS]
    for prompts in batches:
        jobs = [(p, 24, {}) for p in prompts]
        for (p, n, _), (ids, _) in zip(jobs, run_all(spec.url, jobs)):
            assert ids == greedy_reference(model_dir, p, n), p
    after = spec_counters(spec.url)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
    assert 0 < accepted <= drafted
    assert get_json(spec.url + "/info")[1]["speculate"] == 3


def test_seeded_sampling_stop_sequences_and_grammars_answer_as_plain_decoding(servers):
    spec, plain = servers
    jobs = [(p, 20, {"do_sample": True, "seed": 11 + i, "temperature": 0.8}) for i, p in enumerate(PROMPTS[:3])]
    jobs += [(PROMPTS[0], 20, {"repetition_penalty": 1.2}),
             (PROMPTS[4], 20, {"grammar": {"type": "regex", "value": "[a-z ]{4,30}"}})]
    assert run_all(spec.url, jobs) == run_all(plain.url, jobs)
    _, text = run_all(plain.url, [(PROMPTS[1], 24, {})])[0]
    stop = text[len(text) // 2:len(text) // 2 + 3].strip() or text[-2:]
    with_stop = [(PROMPTS[1], 24, {"stop": [stop]})]
    assert run_all(spec.url, with_stop) == run_all(plain.url, with_stop)


def test_streamed_tokens_are_the_answer_and_max_new_tokens_holds(servers, model_dir):
    spec, _ = servers
    client = Client(spec.url, timeout=60)
    prompt = PROMPTS[5]
    streamed = [ev.token.id for ev in client.generate_stream(prompt, max_new_tokens=30)]
    assert streamed == greedy_reference(model_dir, prompt, 30)
    # A request that may fill its whole budget of 128 tokens (prompt + max_new_tokens), several times in a
    # row, while drafts would run past it.
    n_prompt = len(transformers.AutoTokenizer.from_pretrained(model_dir)(prompt).input_ids)
    for _ in range(3):
        out = client.generate(prompt, max_new_tokens=128 - n_prompt)
        assert out.details.generated_tokens == 128 - n_prompt
        assert out.details.finish_reason.value == "length"


def test_conversations_with_prefix_caching_on_two_shards(model_dir, tmp_path):
    srv = serve_small(model_dir, tmp_path, "--speculate", "2", "--num-shard", "2")
    try:
        check_conversations(srv, conversations=3, turns=3)
        for p in PROMPTS[:3]:  # one at a time: each step drafts
            (ids, _), = run_all(srv.url, [(p, 20, {})])
            assert ids == greedy_reference(model_dir, p, 20)
        assert spec_counters(srv.url)["vllm:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        srv.stop()


def test_speculative_steps_on_gaudi_replay_warmed_graphs_only(fake_hpu, model_dir, tmp_path):
    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.params import SamplingParameters
    from gaudi_runtime.router.types import StoppingParameters, ValidRequest

    cfg = config(model_dir, SPECULATE="3")
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    rng = random.Random(5)

    async def traffic(engine):
        async def one(seed):
            r = random.Random(seed)
            pattern = [r.randrange(3, 400) for _ in range(r.randint(2, 5))]
            req = ValidRequest(input_ids=(pattern * 8)[:r.randint(8, 40)], inputs="", sampling=SamplingParameters(),
                               stopping=StoppingParameters(max_new_tokens=r.randint(8, 40)))
            return [ev.token.id async for ev in engine.generate(req)]
        await asyncio.gather(*(one(rng.randrange(1 << 30)) for _ in range(6)))

    info = asyncio.run(serve_in_process(runner, cfg, model_dir, str(tmp_path / "shard"), traffic))
    warmed = buckets.warmup_shape_count(cfg, True)
    assert len(fake_hpu["captures"]) == warmed  # serving captured (compiled) nothing
    assert len(buckets.verify_buckets(cfg)) > 0
    assert "verify" in {k[0] for k in fake_hpu["replays"]}
    assert info["unwarmed_shapes"] == 0 and runner.unwarmed_shapes == 0
    assert json.loads(json.dumps(info))["speculate"] == 3
