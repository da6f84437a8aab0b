"""Granite served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight Granite sets every multiplier far from 1: embeddings x12, a softmax scale of
0.6 (head_dim ** -0.5 would be 0.25), residual branches x0.22 and logits / 8. Greedy tokens catch the
first three; dividing the logits leaves the argmax alone, so the log-probabilities the server reports
are compared with transformers' too. Norm weights get random values.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import PROMPTS, check_concurrent_requests, check_single_requests, serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("granite"), "granite")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"granite-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def reference_logprobs(model_dir, prompt: str, ids: list[int]) -> list[float]:
    """transformers' log-probability of each of `ids` generated after `prompt` (fp32)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = tok(prompt).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(ids)]


def test_logprobs_follow_logits_scaling(server):
    """The reported log-probabilities are those of logits / logits_scaling (without the division they
    would be far sharper)."""
    async def run():
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8, "details": True}}
        async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["details"]["tokens"]

    tokens = asyncio.run(run())
    want = reference_logprobs(server.model_dir, PROMPTS[0], [t["id"] for t in tokens])
    assert [t["logprob"] for t in tokens] == pytest.approx(want, abs=1e-4)


def test_multipliers_default_to_one():
    """A config without the multipliers reads transformers' defaults (1.0), the softmax scale included."""
    from gaudi_runtime.models.granite import GraniteConfig

    base = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    cfg = GraniteConfig.from_dict(base, "GraniteForCausalLM")
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == \
        (1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="logits_scaling"):
        GraniteConfig.from_dict({**base, "logits_scaling": 0}, "GraniteForCausalLM")
