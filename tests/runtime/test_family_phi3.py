"""Phi-3 served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight Phi-3 has what sets Phi-3 apart from Llama: fused ``qkv_proj`` and
``gate_up_proj`` checkpoint tensors (each rank cuts its heads and rows out of them), LongRoPE with an
original length of 48 tokens, Phi-4-mini's partial rotary factor (0.75) and random norm weights.
Short prompts and their answers stay within 48 tokens (the short factor set), a longer prompt is
rotated long throughout, and both kinds share batches (the set is chosen per sequence, not per batch).
A sequence whose answer passes 48 tokens is recomputed with the long set at that step, as transformers'
generate() does; so is it with speculation, and a long prompt prefilled in chunks is rotated long in
every chunk (docs/design.md, "Model code").
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from gaudi_runtime.tools.tiny_model import PHI3_ORIGINAL_LENGTH, make_tiny_model, randomize_vectors
from tests.runtime.family_parity import (
    PROMPTS,
    check_concurrent_requests,
    check_single_requests,
    generate_ids,
    serve,
)
from tests.runtime.launched import SMALL_ARGS, get_json, greedy_reference

# Longer than the LongRoPE original length (48 tokens: 58) and within --max-input-tokens (64).
WORDS = ("kubernetes pod operator cluster node graph warmup bucket prefill decode hello world the a deep serve "
         "request stream answer question data train weight layer attention head vector gaudi card")
LONG_PROMPT = " ".join([WORDS] * 2)
# Prompts of 37 and 48 tokens: their 16-token answers pass the original length (48), the second at once.
CROSSING = [WORDS + " " + " ".join(WORDS.split()[:k]) for k in (8, 19)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"phi3-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_prompt_past_original_length_batched_with_short_ones(server):
    """A prompt longer than the original length alone, then at once with short prompts: each sequence
    gets the factor set transformers gives it alone."""
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(server.model_dir)(LONG_PROMPT).input_ids)
    assert PHI3_ORIGINAL_LENGTH < n <= 64, n
    prompts = [LONG_PROMPT, *PROMPTS[:3]]

    async def run():
        async with aiohttp.ClientSession() as s:
            alone = await generate_ids(s, server.url, LONG_PROMPT, 16)
            together = await asyncio.gather(*(generate_ids(s, server.url, p, 16) for p in prompts))
            return alone, together

    alone, together = asyncio.run(run())
    assert alone == greedy_reference(server.model_dir, LONG_PROMPT, 16)
    for prompt, got in zip(prompts, together):
        assert got == greedy_reference(server.model_dir, prompt, 16), prompt


def _prompt_len(model_dir, prompt: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir)(prompt).input_ids)


def _check_alone_then_together(srv, prompts: list[str], n: int = 16) -> None:
    async def run():
        async with aiohttp.ClientSession() as s:
            alone = [await generate_ids(s, srv.url, p, n) for p in prompts]
            together = await asyncio.gather(*(generate_ids(s, srv.url, p, n) for p in prompts))
            return alone, together

    alone, together = asyncio.run(run())
    for prompt, one, many in zip(prompts, alone, together):
        want = greedy_reference(srv.model_dir, prompt, n)
        assert one == want, prompt
        assert many == want, prompt
    code, info = get_json(srv.url + "/info")
    assert code == 200 and info["kv_blocks_free"] == info["kv_blocks"]


def test_answer_passing_the_original_length_is_recomputed_long(server):
    """A prompt within the original length whose answer passes it: from the token at that length on,
    transformers recomputes the whole sequence with the long set; so do we, alone and batched with a
    short and a long prompt."""
    lens = [_prompt_len(server.model_dir, p) for p in CROSSING]
    assert lens == [37, PHI3_ORIGINAL_LENGTH], lens
    _check_alone_then_together(server, [*CROSSING, PROMPTS[0], LONG_PROMPT])


@pytest.fixture(scope="module")
def chunked_speculating(model_dir, tmp_path_factory):
    """A server that prefills prompts in chunks of 16 tokens and drafts 3 tokens a step."""
    srv = serve(model_dir, tmp_path_factory.mktemp("phi3-chunks"), 1,
                args=(*SMALL_ARGS, "--max-batch-prefill-tokens", "16", "--speculate", "3"))
    yield srv
    srv.stop()


def test_long_prompt_prefilled_in_chunks_is_rotated_long_throughout(chunked_speculating):
    """The chunks of a prompt longer than the original length that end below it read the long set, as the
    whole prompt does."""
    _check_alone_then_together(chunked_speculating, [LONG_PROMPT, PROMPTS[1]])
    assert get_json(chunked_speculating.url + "/info")[1]["prefill_chunks"] >= 3


def test_speculation_never_straddles_the_original_length(chunked_speculating):
    """With drafts, the answers that pass the original length are transformers' all the same."""
    assert get_json(chunked_speculating.url + "/info")[1]["speculate"] == 3
    _check_alone_then_together(chunked_speculating, [*CROSSING, LONG_PROMPT])


def test_which_requests_are_prefilled_again():
    """After the token at the original length (32): a greedy request within it whose answer passes it,
    unless that prefill would not fit a prefill's shape or the shard's sampling state would be lost."""
    from gaudi_runtime.params import SamplingParameters
    from gaudi_runtime.router.prefix_cache import reprefill_at
    from gaudi_runtime.router.types import StoppingParameters, ValidRequest

    def req(n, new, **sampling):
        return ValidRequest(list(range(n)), "", SamplingParameters(**sampling), StoppingParameters(new))

    assert reprefill_at(req(20, 16), 32, 64) == 13  # tokens 1..13 short: token 13 sits at position 32
    assert reprefill_at(req(32, 2), 32, 64) == 1
    assert reprefill_at(req(20, 13), 32, 64) is None  # its last token is the one at position 32
    assert reprefill_at(req(33, 16), 32, 64) is None  # long from the start
    assert reprefill_at(req(20, 16), None, 64) is None  # no LongRoPE
    assert reprefill_at(req(20, 16), 32, 32) is None  # a prefill of 33 tokens does not fit
    assert reprefill_at(req(20, 16, do_sample=True), 32, 64) is None
    assert reprefill_at(req(20, 16, presence_penalty=0.5), 32, 64) is None


def _rope_config_v4() -> dict:
    """Phi-3.5-mini's config.json layout (transformers 4's: ``rope_scaling``, the original length at the
    top level only)."""
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                             "long_factor": [1.0, 3.0, 7.0, 15.0, 31.0, 63.0]}}


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_longrope_tables_match_transformers(layout):
    """cos/sin of every position, for a prompt of each length and a decode step at each position, equal
    transformers' Phi3RotaryEmbedding (short or long set, attention factor, partial rotary)."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from gaudi_runtime.models.base import rotary_embedding
    from gaudi_runtime.models.phi3 import Phi3Config

    raw = _rope_config_v4()
    ref_cfg = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    if layout == "v5":  # the layout transformers 5 writes
        raw = {**ref_cfg.to_dict(), "architectures": raw["architectures"]}
    ours = rotary_embedding(Phi3Config.from_dict(raw, "Phi3ForCausalLM"), torch.float32, torch.device("cpu"))
    assert ours.rotary_dim == 12
    ref = Phi3RotaryEmbedding(ref_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    for length in (1, 20, 32, 33, 100, 256):
        prompt = torch.arange(length)[None]  # one prefill row of `length` tokens
        step = torch.tensor([[length - 1]])  # one decode row at the last position
        for positions in (prompt, step):
            cos, sin = ref(x, positions)
            rows = ours.table_rows(positions)
            torch.testing.assert_close(ours.cos[rows], cos[..., :6], atol=0, rtol=0)
            torch.testing.assert_close(ours.sin[rows], sin[..., :6], atol=0, rtol=0)


def test_longrope_rows_choose_their_set_per_row():
    """In one batch, a row reaching the original length reads the long rows and a shorter one the short."""
    from gaudi_runtime.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 8,
               "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    rope = RotaryEmbedding(4, 64, scaling=scaling)
    positions = torch.tensor([[0, 1, 2, 0], [5, 6, 7, 8], [7, 0, 0, 0], [8, 0, 0, 0]])  # pads at position 0
    assert rope.table_rows(positions).tolist() == [[0, 1, 2, 0], [13, 14, 15, 16], [7, 0, 0, 0], [16, 8, 8, 8]]
    # A chunk below the original length of a longer prompt, marked long (shard/inputs.py mark_long_rows).
    marked = torch.tensor([[64 + 2, 64 + 3, 0], [2, 3, 0]])
    assert rope.table_rows(marked).tolist() == [[10, 11, 8], [2, 3, 0]]
    assert rope.cos.shape == (8 + 64, 2)


def test_chunks_of_a_long_prompt_are_marked_long():
    import numpy as np

    from gaudi_runtime.params import SamplingParameters
    from gaudi_runtime.shard.inputs import PrefillInput, mark_long_rows

    def req(n, cached=0, whole=0):
        return PrefillInput(0, list(range(n)), SamplingParameters(), 0, [], False, cached_tokens=cached,
                            sequence_tokens=whole)

    positions = np.array([[4, 5, 6, 0], [4, 5, 6, 0], [0, 1, 2, 3]])
    reqs = [req(7, cached=4, whole=20), req(7, cached=4), req(4)]
    mark_long_rows(positions, reqs, 8, 64)
    assert positions.tolist() == [[68, 69, 70, 0], [4, 5, 6, 0], [0, 1, 2, 3]]


def test_drafts_stop_before_the_original_length():
    """A row below the original length drafts only up to the position before it; one past it, freely."""
    from gaudi_runtime.shard.speculation import DraftRows, RowTokens

    loop = [5, 6, 7] * 4  # a repeating text: the n-gram drafter always has a draft
    rows = DraftRows.of([RowTokens.of(loop[:10], loop[10], 20), RowTokens.of(loop[:11], loop[11], 20)])
    plan = rows.plan(3, 8, (), long_from=13)  # rows of 11 and 12 tokens: their next windows start at 10, 11
    assert ((plan[:, 1:] >= 0).sum(axis=1)).tolist() == [2, 1]
    assert ((rows.plan(3, 8, (), long_from=8)[:, 1:] >= 0).sum(axis=1)).tolist() == [3, 3]


def test_partial_rotary_passes_the_rest_through():
    from gaudi_runtime.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, 32, rotary_dim=12)
    q, k = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16)
    rq, rk = rope(torch.tensor([[0, 5, 9]]), q, k)
    assert torch.equal(rq[..., 12:], q[..., 12:]) and torch.equal(rk[..., 12:], k[..., 12:])
    assert not torch.equal(rq[:, 1:, :, :12], q[:, 1:, :, :12])


def test_legacy_su_type_reads_as_longrope():
    from gaudi_runtime.models.phi3 import Phi3Config

    raw = _rope_config_v4()
    raw["rope_scaling"] = {**raw["rope_scaling"], "type": "su"}
    cfg = Phi3Config.from_dict(raw, "Phi3ForCausalLM")
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32


def test_router_reads_the_original_length_the_model_uses():
    """The prefix cache keeps long and short prompts' blocks apart at the length the rotary switches at."""
    from gaudi_runtime.models.phi3 import Phi3Config
    from gaudi_runtime.router.prefix_cache import longrope_original_length

    v4 = _rope_config_v4()
    no_top = {k: v for k, v in v4.items() if k != "original_max_position_embeddings"}
    su = {**v4, "rope_scaling": {**v4["rope_scaling"], "type": "su"}}
    for raw in (v4, no_top, su):
        model = Phi3Config.from_dict(raw, "Phi3ForCausalLM").rope_scaling["original_max_position_embeddings"]
        assert longrope_original_length(raw) == model
    assert longrope_original_length(no_top) == 4096  # Phi3Config's default, as transformers reads it
    assert longrope_original_length(v4, rope_override="linear") is None
    assert longrope_original_length({"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}}) is None
