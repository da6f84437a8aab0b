"""--batch-invariant as a user meets it, in bfloat16: a request's greedy tokens are the ones it gets alone,
whole and uncached, whether it arrives in a batch of 8, its long prompt is prefilled in chunks, its prefix
comes from the prefix cache, or the server speculates (`--speculate 3`).

One server runs the stressed paths at once (vLLM's VLLM_BATCH_INVARIANT=1, KV blocks of 4 tokens, chunks
of 32, prefix caching, --speculate 3) on the `wide` tiny model, where the default mode gives other tokens in
a batch of 8, chunked and cached; the reference is each prompt alone through an in-process engine in the
mode (BATCH_INVARIANT, blocks of 16, no chunking, no prefix cache, no speculation). Speculation is checked
in-process on the tiny model, whose answers loop so that drafts are accepted. Without the mode every test
here but the /info one fails (docs/design.md, "The batch-invariant mode")."""

from __future__ import annotations

import asyncio
import random

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


def in_process(model_dir, sock_dir, groups: list[list[str]], **settings: str) -> tuple[dict, list[int]]:
    """Each group's prompts at once through an in-process engine in the mode, group after group, with
    `settings` over whole prompts, no prefix cache and no drafts; returns each prompt's greedy tokens and the
    drafts each speculative step accepted."""
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "DTYPE": "bfloat16", "BATCH_INVARIANT": "true",
                         "PREFIX_CACHING": "false", "MAX_INPUT_TOKENS": "200", "MAX_TOTAL_TOKENS": "256",
                         "MAX_BATCH_PREFILL_TOKENS": "256", "BLOCK_SIZE": "16", "WARMUP_ENABLED": "false", **settings})
    runner = ModelRunner(cfg, str(model_dir), CpuBackend())
    accepted, decode = [], runner.decode

    def counted(batches):
        batch_id, result = decode(batches)
        if result.spec is not None:
            accepted.append(result.spec.accepted)
        return batch_id, result

    runner.decode = counted
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = {}

    async def one(engine, prompt):
        req = ValidRequest(input_ids=tok(prompt).input_ids, inputs=prompt, sampling=SamplingParameters(),
                           stopping=StoppingParameters(max_new_tokens=NEW_TOKENS))
        out[prompt] = [ev.token.id async for ev in engine.generate(req)]

    async def traffic(engine):
        for group in groups:
            await asyncio.gather(*(one(engine, p) for p in group))

    asyncio.run(serve_in_process(runner, cfg, model_dir, str(sock_dir / "shard"), traffic))
    return out, accepted


@pytest.fixture(scope="module")
def alone(model_dir, tmp_path_factory) -> dict[str, list[int]]:
    """Each prompt's greedy tokens alone: one request at a time, whole prompts, nothing cached, no drafts."""
    return in_process(model_dir, tmp_path_factory.mktemp("alone"), [[p] for p in PROMPTS])[0]


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


def test_speculative_steps_give_the_tokens_of_plain_decoding(tmp_path):
    """In-process on the tiny model, whose greedy answers loop, so that drafts are accepted (the wide one's
    do not): rows two at a time with 3 drafts a step against each prompt alone without drafts."""
    model_dir = make_tiny_model(tmp_path / "tiny", "llama")
    groups = [REPEATING[:2], REPEATING[2:], [REPEATING[0], BATCH[0]], [LONG, BATCH[1]]]
    plain, _ = in_process(model_dir, tmp_path, [[p] for group in groups for p in group])
    speculated, accepted = in_process(model_dir, tmp_path, groups, SPECULATE="3", PREFIX_CACHING="true",
                                      BLOCK_SIZE="4", MAX_BATCH_PREFILL_TOKENS="32")
    assert speculated == plain
    assert sum(accepted) > 0
