"""--batch-invariant as a user meets it, in bfloat16: a request's greedy tokens are the ones it gets alone,
whole and uncached, whether it arrives in a batch of 8, its long prompt is prefilled in chunks, its prefix
comes from the prefix cache, or the server speculates (`--speculate 3`).

One server runs every stressed path at once (vLLM's VLLM_BATCH_INVARIANT=1, KV blocks of 4 tokens, chunks
of 32, prefix caching, 3 drafts a step); the reference is each prompt alone through an in-process engine in
the mode (BATCH_INVARIANT, blocks of 16, no chunking, no prefix cache, no speculation). Without the mode
(today's kernels) the batch and the speculative steps give other tokens here (docs/design.md,
"Batch-invariant mode")."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import aiohttp
import pytest
import transformers

from gaudi_runtime.config import resolve
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router.types import StoppingParameters, ValidRequest
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, serve_small
from tests.runtime.prefix_checks import generate
from tests.runtime.test_warmup import serve_in_process

pytestmark = pytest.mark.slow

NEW_TOKENS = 48  # the tiny model's batch-dependent tokens appear late: a row's logits differ in the last bits
_rng = random.Random(3)
_WORDS = "the a deep model card shard router token batch cache serve stream answer layer attention head".split()
BATCH = [" ".join(_rng.choice(_WORDS) for _ in range(_rng.randint(3, 30))) for _ in range(8)]
LONG = " ".join(_rng.choice(_WORDS) for _ in range(110))  # past three chunks of 32 tokens
LONGER = LONG + " and then the router answers the question"  # LONG's blocks from the prefix cache, then its tail
# Text that repeats itself: drafts of the n-gram lookup get accepted.
REPEATING = ["the cat the cat the cat the cat", "a b c d e f a b c d e f a b", "one two one two one two",
             "gaudi card shard gaudi card shard gaudi"]
PROMPTS = BATCH + [LONG, LONGER] + REPEATING


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", size="wide")


@pytest.fixture(scope="module")
def alone(model_dir, tmp_path_factory) -> dict[str, list[int]]:
    """Each prompt's greedy tokens alone: one request at a time, whole prompts, nothing cached, no drafts."""
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "DTYPE": "bfloat16", "BATCH_INVARIANT": "true",
                         "PREFIX_CACHING": "false", "MAX_INPUT_TOKENS": "200", "MAX_TOTAL_TOKENS": "256",
                         "MAX_BATCH_PREFILL_TOKENS": "256", "BLOCK_SIZE": "16", "WARMUP_ENABLED": "false"})
    runner = ModelRunner(cfg, str(model_dir), CpuBackend())
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = {}

    async def traffic(engine):
        for p in PROMPTS:
            req = ValidRequest(input_ids=tok(p).input_ids, inputs=p, sampling=SamplingParameters(),
                               stopping=StoppingParameters(max_new_tokens=NEW_TOKENS))
            out[p] = [ev.token.id async for ev in engine.generate(req)]

    sock = str(tmp_path_factory.mktemp("alone") / "shard")
    asyncio.run(serve_in_process(runner, cfg, model_dir, sock, traffic))
    return out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = serve_small(model_dir, tmp_path_factory.mktemp("invariant"), "--dtype", "bfloat16", "--max-input-tokens",
                      "200", "--max-total-tokens", "256", "--max-batch-prefill-tokens", "32", "--prefix-caching",
                      "true", "--speculate", "3", env={"VLLM_BATCH_INVARIANT": "1"})
    yield srv
    srv.stop()


def run_together(url: str, prompts: list[str]) -> list[list[int]]:
    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(generate(s, url, p, NEW_TOKENS) for p in prompts))
    return [ids for ids, _ in asyncio.run(run())]


def info(url: str) -> dict:
    code, out = get_json(url + "/info")
    assert code == 200
    return out


def accepted_drafts(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))


def test_the_mode_is_on_and_reported(server):
    got = info(server.url)
    assert got["batch_invariant"] is True and "batch-invariant" in got["attention"] and got["speculate"] == 3


def test_a_batch_of_8_gives_each_prompt_its_tokens_alone(server, alone):
    for prompt, ids in zip(BATCH, run_together(server.url, BATCH), strict=True):
        assert ids == alone[prompt], prompt


def test_chunked_and_prefix_cached_prompts_give_their_tokens_alone(server, alone):
    before = info(server.url)
    assert run_together(server.url, [LONG]) == [alone[LONG]]  # chunked
    assert run_together(server.url, [LONGER]) == [alone[LONGER]]  # LONG's blocks cached, the tail chunked
    assert run_together(server.url, [LONG, *BATCH[:3]]) == [alone[p] for p in (LONG, *BATCH[:3])]  # cached, batched
    after = info(server.url)
    assert after["prefill_chunks"] > before["prefill_chunks"]
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_speculative_steps_give_the_tokens_of_plain_decoding(server, alone):
    before = accepted_drafts(server.url)
    for group in (REPEATING[:2], REPEATING[2:], REPEATING[:1] + BATCH[:1]):  # few rows: drafts are verified
        assert run_together(server.url, group) == [alone[p] for p in group], group
    assert accepted_drafts(server.url) > before
