"""`from gaudi_runtime import LLM, SamplingParams`: the engine in-process, against `transformers`."""

from __future__ import annotations

import os

import pytest

from gaudi_runtime import LLM, SamplingParams
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import alive, children, greedy_reference

PROMPTS = ["What is deep learning?", "the gaudi card", "hello world", "kubernetes pod operator cluster node",
           "a", "café naïve über"]
# The small shapes of tests/runtime/launched.py's SMALL_ARGS / SMALL_ENV, as keyword arguments.
SMALL = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 8, "max_input_tokens": 64,
         "max_batch_prefill_tokens": 128, "block_size": 4, "pad_sequence_to_multiple_of": 16,
         "batch_bucket_size": 4, "prefill_batch_bucket_size": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("offline") / "llama", "llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=model_dir, **SMALL) as engine:
        yield engine


def test_greedy_batch_equals_transformers(llm, model_dir):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    for out in outs:
        want = greedy_reference(model_dir, out.prompt, 12)
        done = out.outputs[0]
        assert done.token_ids == want, out.prompt
        assert done.text == llm.get_tokenizer().decode(want)
        assert done.finish_reason == ("length" if len(want) == 12 else "stop")


def test_token_id_prompts_and_per_prompt_parameters(llm, model_dir):
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    short = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate([ids, PROMPTS[1]], [GREEDY, short])
    assert outs[0].prompt is None and outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == greedy_reference(model_dir, PROMPTS[0], 12)
    assert outs[1].outputs[0].token_ids == greedy_reference(model_dir, PROMPTS[1], 3)
    single = llm.generate(PROMPTS[2], short)  # one prompt: a list of one output, as vLLM
    assert len(single) == 1 and single[0].outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm):
    def sample(seed):
        return llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=10))

    first, again, other = sample(7), sample(7), sample(8)
    ids = [[o.outputs[0].token_ids for o in run] for run in (first, again, other)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


def test_stop_string_ends_with_stop_and_is_left_out(llm):
    full = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    # A two-character stop string whose first occurrence starts after the first character.
    at = next(i for i in range(1, len(full) - 2) if full.find(full[i:i + 2]) == i and full[i:i + 2].strip())
    stop = full[at:at + 2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:at], "stop", stop)
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[:at + 2]


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=1000), "max_new_tokens"),
    (SamplingParams(stop=["a", "b", "c", "d", "e"]), "stop"),
])
def test_invalid_parameters_raise_value_error_with_the_routers_message(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", params)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens")])
def test_out_of_range_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_setting_is_refused_before_anything_starts(model_dir):
    with pytest.raises(TypeError, match="max_tokns"):
        LLM(model=model_dir, max_tokns=3)


def test_two_shards_match_and_close_leaves_no_process(model_dir):
    before = set(children(os.getpid()))
    llm = LLM(model=model_dir, num_shard=2, **SMALL)
    shards = [p.pid for _, p in llm._procs]
    assert len(shards) == 2 and all(alive(pid) for pid in shards)
    outs = llm.generate(PROMPTS[:3], GREEDY)
    for out in outs:
        assert out.outputs[0].token_ids == greedy_reference(model_dir, out.prompt, 12)
    llm.close()
    assert not any(alive(pid) for pid in shards)
    assert set(children(os.getpid())) <= before
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hello", GREEDY)
    llm.close()  # idempotent


def test_penalties_mean_what_they_mean_in_vllm(llm, model_dir):
    """SamplingParams' frequency and presence penalties count the generated tokens, as in vLLM and OpenAI."""
    from tests.runtime.test_openai_penalties import MAX_TOKENS, PROMPT, penalised_greedy

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, presence_penalty=2.0, frequency_penalty=0.5,
                            ignore_eos=True)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.text == penalised_greedy(model_dir, PROMPT, MAX_TOKENS, presence=2.0, frequency=0.5)
