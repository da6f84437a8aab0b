"""The shards' tokens become each request's stream events: the text each token adds, and on the last
one why the request ended and what it generated; the request's KV blocks go back then."""

from __future__ import annotations

import math

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests, RequestState
from gaudi_runtime.router.output import OutputProcessor
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import FinishReason, StoppingParameters, ValidRequest
from gaudi_runtime.tools.tiny_model import train_tokenizer

BLOCKS = 64
PROMPT = "the gaudi"


@pytest.fixture(scope="module")
def tok() -> RouterTokenizer:
    return RouterTokenizer(train_tokenizer())


def running(tok, top_n_tokens: int = 0, decoder_input_details: bool = False,
            **stopping) -> tuple[OutputProcessor, Requests, RequestState]:
    """An output processor and one request whose prefill was made."""
    requests = Requests(resolve(None, {"MODEL_ID": "unused"}), EngineMetrics(None))
    requests.allocator = BlockAllocator(BLOCKS)
    output = OutputProcessor(tok, requests)
    output.eos_ids = set(tok.eos_token_ids)
    stopping.setdefault("max_new_tokens", 20)
    state = requests.add(ValidRequest(input_ids=tok.encode(PROMPT), inputs=PROMPT, sampling=SamplingParameters(),
                                      stopping=StoppingParameters(**stopping), top_n_tokens=top_n_tokens,
                                      decoder_input_details=decoder_input_details), tok)
    assert requests.take(1) == [state] and requests.allocator.free_count < BLOCKS
    return output, requests, state


def answer(output: OutputProcessor, state: RequestState, ids: list[int]) -> list:
    """Answer `ids` for the request, one step each, as the shards do; returns the events its caller reads."""
    for t in ids:
        output.process(pb.Generations(request_ids=[state.id], token_ids=[t], logprobs=[-0.5]))
    events = []
    while not state.events.empty():
        events.append(state.events.get_nowait())
    return events


def assert_ended(requests: Requests, state: RequestState) -> None:
    assert state.ended and requests.get(state.id) is None
    assert requests.allocator.free_count == BLOCKS


def test_a_stop_sequence_spanning_tokens_ends_the_request_with_the_token_that_completes_it(tok):
    output, requests, state = running(tok, stop_sequences=(" card se",))
    ids = tok.encode(" card serve request stream")
    assert [tok.decode([i]) for i in ids[:2]] == [" card", " serve"]  # the stop sequence ends inside a token
    events = answer(output, state, ids)
    assert [e.token.text for e in events] == [" card", " serve"]  # tokens after it are dropped
    assert [e.end is None for e in events] == [True, False]
    end = events[-1].end
    assert end.finish_reason == FinishReason.STOP_SEQUENCE
    assert end.generated_text == " card serve" and end.generated_tokens == 2  # the whole token, as TGI
    assert_ended(requests, state)


def test_eos_ends_the_request_and_shows_as_its_own_text_but_not_in_the_generated_text(tok):
    output, requests, state = running(tok)
    eos = tok.eos_token_ids[0]
    events = answer(output, state, tok.encode(" card") + [eos, tok.encode(" serve")[0]])
    assert len(events) == 2
    assert events[-1].token.special and events[-1].token.text == tok.decode([eos])
    assert events[-1].end.finish_reason == FinishReason.EOS_TOKEN
    assert events[-1].end.generated_text == " card" and events[-1].end.generated_tokens == 2
    assert_ended(requests, state)


def test_ignore_eos_token_runs_on_to_the_length_limit(tok):
    output, requests, state = running(tok, max_new_tokens=3, ignore_eos_token=True)
    eos = tok.eos_token_ids[0]
    events = answer(output, state, [eos, eos, eos, eos])
    assert len(events) == 3 and events[-1].end.finish_reason == FinishReason.LENGTH
    assert_ended(requests, state)


def test_max_new_tokens_ends_the_request_and_the_streamed_text_adds_up(tok):
    text = "🎉 日本語 東京"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters that span several tokens
    output, requests, state = running(tok, max_new_tokens=len(ids))
    events = answer(output, state, ids + ids)
    assert len(events) == len(ids)
    end = events[-1].end
    assert end.finish_reason == FinishReason.LENGTH and end.generated_tokens == len(ids)
    assert "".join(e.token.text for e in events) == end.generated_text == text
    assert all(e.end is None for e in events[:-1])
    assert end.queue_time >= 0 and end.inference_time >= 0
    assert_ended(requests, state)


def test_a_token_for_a_cancelled_request_is_dropped(tok):
    output, requests, state = running(tok)
    requests.end(state)  # its caller went away while a call naming it was in flight
    assert_ended(requests, state)
    gens = pb.Generations(request_ids=[state.id], token_ids=tok.encode(" card"), logprobs=[-0.5])
    assert output.process(gens) == []
    assert state.events.empty()
    assert requests.allocator.free_count == BLOCKS


def test_requests_still_running_are_returned_and_their_events_keep_streaming(tok):
    output, requests, state = running(tok, max_new_tokens=2)
    card, serve = tok.encode(" card serve")
    assert output.process(pb.Generations(request_ids=[state.id], token_ids=[card], logprobs=[-0.5])) == [state.id]
    assert state.events.get_nowait().token.text == " card" and not state.ended
    assert output.process(pb.Generations(request_ids=[state.id], token_ids=[serve], logprobs=[-0.5])) == []
    assert state.events.get_nowait().end.finish_reason == FinishReason.LENGTH


def test_prompt_and_top_tokens_carry_their_own_text(tok):
    output, requests, state = running(tok, top_n_tokens=2, decoder_input_details=True, max_new_tokens=1)
    prompt = tok.encode(PROMPT)
    card, serve = tok.encode(" card serve")
    output.process(pb.Generations(
        request_ids=[state.id], token_ids=[card], logprobs=[-0.5], top_n=2, top_ids=[card, serve],
        top_logprobs=[-0.5, -1.5],
        prefill=[pb.PrefillLogprobs(request_id=state.id, logprobs=[math.nan] + [-1.0] * (len(prompt) - 1))]))
    event = state.events.get_nowait()
    assert [(t.text, t.logprob) for t in event.top_tokens] == [(" card", -0.5), (" serve", -1.5)]
    assert [t.text for t in event.end.prefill] == [tok.decode([i]) for i in prompt]
    assert math.isnan(event.end.prefill[0].logprob) and event.end.prefill[1].logprob == -1.0
    assert_ended(requests, state)
