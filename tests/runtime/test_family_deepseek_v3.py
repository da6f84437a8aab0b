"""DeepSeek-V3 (multi-head latent attention, grouped-routed experts with a shared expert, yarn rope) equals
transformers' greedy output.

In process: prefill logits, and greedy generation through the paged latent cache (shuffled blocks of
4 tokens, decode with the absorbed projections), with and without ``q_lora_rank``. Served: 1 and 2
shards (each rank holds half the heads and half of every expert, and the whole latent), then with
prefix caching (conversations resending their history) with chunked prefill, and ``--speculate 3``;
every answer is transformers' greedy output token for token. On Gaudi (the recording fake) decode reads
the latent over the flat block layout with warmed shapes only, giving the CPU path's tokens; and the
shard sizes its cache by the latent's bytes.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from gaudi_runtime.models import load_model
from gaudi_runtime.tools.tiny_model import make_config, make_tiny_model, randomize_vectors
from tests.runtime.family_parity import (
    PROMPTS,
    check_concurrent_requests,
    check_single_requests,
    generate_ids,
    serve,
)
from tests.runtime.forward_parity import assert_prefill_logits_match, write_model
from tests.runtime.launched import SMALL_ARGS, get_json, greedy_reference
from tests.runtime.prefix_checks import SYSTEM, check_conversations
from tests.runtime.test_model_parity import _check_greedy, _prompts, _reference

LATENT = "multi-head latent attention"  # what /info says decodes: the latent, not the CPU's paged kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")
    randomize_vectors(path)  # norm weights and e_score_correction_bias away from 1 and 0: routing uses the bias
    return path


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "plain_q_proj"])
def test_prefill_and_paged_greedy_match_transformers(tmp_path, q_lora_rank):
    d = write_model(make_config("deepseek_v3", 512, q_lora_rank=q_lora_rank), tmp_path / "m")
    assert_prefill_logits_match(d)
    model = load_model(str(d), torch.float32, torch.device("cpu"))
    assert model.kv_token_shapes == ((1, 32), (1, 16))  # the latent and the rope key, not keys and values
    _check_greedy(model, _reference(str(d)), _prompts(model.vocab_size, seed=1))


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"deepseek-{request.param}"), request.param,
                env={"BATCH_BUCKET_SIZE": "2"})
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server, attention=LATENT)


@pytest.mark.parametrize("shards", [1, 2])
def test_prefix_caching_and_chunked_prefill_match_transformers(model_dir, tmp_path, shards):
    """Conversations resending their history hit the cache (the later turns read the cached latent), and
    prompts longer than 16 tokens are prefilled in chunks over the latent of their earlier chunks."""
    srv = serve(model_dir, tmp_path, shards, args=(*SMALL_ARGS, "--prefix-caching", "true",
                                                   "--max-batch-prefill-tokens", "16"))
    try:
        prompt = SYSTEM + " the gaudi card shard router token batch cache serve request stream answer"
        check_prompts(srv, [prompt], 8)
        code, info = get_json(srv.url + "/info")
        assert code == 200 and info["prefill_chunks"] >= 1
        check_conversations(srv, conversations=3, turns=3)
    finally:
        srv.stop()


def check_prompts(srv, prompts: list[str], max_new_tokens: int) -> None:
    async def run():
        async with aiohttp.ClientSession() as s:
            return [await generate_ids(s, srv.url, p, max_new_tokens) for p in prompts]

    for prompt, got in zip(prompts, asyncio.run(run())):
        assert got == greedy_reference(srv.model_dir, prompt, max_new_tokens), prompt


def test_speculation_matches_transformers(model_dir, tmp_path):
    """Drafts verified over the cached latent (a prefill over cached blocks) keep transformers' tokens."""
    srv = serve(model_dir, tmp_path, 2, args=(*SMALL_ARGS, "--speculate", "3"))
    try:
        check_prompts(srv, PROMPTS[:4], 16)
        check_concurrent_requests(srv, attention=LATENT)
    finally:
        srv.stop()


def test_hpu_decodes_the_latent_over_flat_blocks_with_the_cpu_paths_tokens(fake_hpu, model_dir):
    """On Gaudi (the recording fake), MLA and the grouped experts run with the shapes warmup compiled,
    decode reads the latent over the flat block layout, and the tokens are the CPU path's."""
    from gaudi_runtime.device.base import Backend
    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.shard.runner import ModelRunner
    from tests.runtime.test_hpu_paged_decode import config, generate

    cfg = config(model_dir)
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    assert hpu.flat_decode
    assert [tuple(t.shape[2:]) for t in hpu.kv_cache[0]] == [(1, 32), (1, 16)]
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    on_hpu = generate(hpu)
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0  # serving compiled nothing
    assert any(name == "decode" and len(shapes[3]) == 1 for name, shapes in fake_hpu["replays"])  # flat blocks
    cpu = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    assert generate(cpu) == on_hpu


def test_the_kv_budget_counts_latent_bytes(model_dir):
    """With the device's free memory known, the shard fits as many blocks as the latent's bytes allow: 48
    values per token and layer (the 32-wide latent and the 16-wide rope key), not keys and values of 4
    heads of 32 (256)."""
    from gaudi_runtime.device.base import Backend
    from gaudi_runtime.shard.runner import ModelRunner
    from tests.runtime.test_hpu_paged_decode import config

    cfg = config(model_dir)
    per_block = 3 * cfg.device.block_size * (32 + 16) * 4  # layers x tokens x values x float32

    class KnownMemory(Backend):
        def memory_info(self):
            return int(100 * per_block / cfg.device.memory_fraction) + 1, 2**40

    runner = ModelRunner(cfg, str(model_dir), KnownMemory(torch.device("cpu")))
    assert runner.num_blocks == 100
    assert sum(t.numel() * t.element_size() for layer in runner.kv_cache for t in layer) == 100 * per_block
