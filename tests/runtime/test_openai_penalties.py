"""OpenAI's presence and frequency penalties on the real server (launcher, shard, router), against
their definition applied by hand to `transformers`' logits of the same weights:
logit[j] -= frequency_penalty * n[j] + presence_penalty * (n[j] > 0), n = times j was generated."""

from __future__ import annotations

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, launch

# Greedy decoding of the tiny model repeats tokens within 16 for this prompt, so a penalty changes it.
PROMPT = "the gaudi card serve request"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("penalties") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = launch(model_dir, tmp_path_factory.mktemp("penalties-run"), *SMALL_ARGS, env=SMALL_ENV)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def penalised_greedy(model_dir, prompt: str, n: int, presence: float = 0.0, frequency: float = 0.0) -> str:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    generated = torch.zeros(model.config.vocab_size)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1].float()
            logits = logits - frequency * generated - presence * (generated > 0).float()
            token = int(logits.argmax())
            assert token != tok.eos_token_id, "pick a prompt whose answer does not end early"
            out.append(token)
            generated[token] += 1
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tok.decode(out)


async def complete(url: str, **extra) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    assert data["usage"]["completion_tokens"] == MAX_TOKENS
    return data["choices"][0]["text"]


async def test_presence_penalty_changes_greedy_output_as_openai_defines_it(server, model_dir):
    plain = await complete(server.url)
    penalised = await complete(server.url, presence_penalty=2.0)
    assert penalised != plain
    assert plain == penalised_greedy(model_dir, PROMPT, MAX_TOKENS)
    assert penalised == penalised_greedy(model_dir, PROMPT, MAX_TOKENS, presence=2.0)


async def test_frequency_penalty_counts_generated_tokens_as_openai_defines_it(server, model_dir):
    got = await complete(server.url, frequency_penalty=1.5, presence_penalty=-0.5)
    assert got != await complete(server.url)
    assert got == penalised_greedy(model_dir, PROMPT, MAX_TOKENS, presence=-0.5, frequency=1.5)


async def test_penalty_out_of_range_is_a_400_naming_it(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "presence_penalty": 2.5}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/completions", json=body) as r:
        assert r.status == 400
        assert (await r.json()) == {"error": {"message": "`presence_penalty` must be >= -2.0 and <= 2.0. Given: 2.5",
                                              "type": "BadRequestError", "param": None, "code": None}}
