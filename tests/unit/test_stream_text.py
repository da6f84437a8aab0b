"""Stream events rendered from templates are, byte for byte, what `json.dumps` of their dicts writes:
what every client got when each event was serialized whole."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router import json_text
from gaudi_runtime.router.http_common import finite_logprob
from gaudi_runtime.router.openai_api import Envelope
from gaudi_runtime.router.tgi_api import stream_event_json, stream_event_text
from gaudi_runtime.router.types import (
    FinishReason,
    GenerationEnd,
    StoppingParameters,
    StreamEvent,
    Token,
    ValidRequest,
)

logprobs = st.one_of(st.floats(), st.none(), st.integers(-10, 0), st.sampled_from([-0.0, 5e-324, -1e300]))
tokens = st.builds(Token, id=st.integers(0, 2**31), text=st.text(), logprob=logprobs, special=st.booleans())
ends = st.one_of(st.none(), st.builds(
    GenerationEnd, finish_reason=st.sampled_from(list(FinishReason)), generated_text=st.text(),
    generated_tokens=st.integers(1, 100), seed=st.one_of(st.none(), st.integers(0, 2**63))))


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@given(v=logprobs)
def test_a_logprob_is_json_or_null(v):
    assert json_text.logprob(v) == dumps(finite_logprob(v))


@given(text=st.text())
def test_a_string_is_quoted_and_escaped_as_json_dumps_does(text):
    assert json_text.string(text) == dumps(text)


@given(index=st.integers(1, 10**6), token=tokens, tops=st.lists(tokens, max_size=3), end=ends,
       prompt=st.text(max_size=8), full_text=st.booleans())
def test_tgi_stream_event_text_is_json_dumps_of_its_dict(index, token, tops, end, prompt, full_text):
    request = ValidRequest(input_ids=[1, 2], inputs=prompt, sampling=SamplingParameters(),
                           stopping=StoppingParameters(max_new_tokens=4), return_full_text=full_text)
    ev = StreamEvent(token, tops, end)
    assert stream_event_text(index, ev, request) == dumps(stream_event_json(index, ev, request))


@given(model=st.text(), object_type=st.sampled_from(["text_completion", "chat.completion.chunk"]),
       choice=st.dictionaries(st.text(max_size=5), st.one_of(st.text(), st.integers(), st.none()), max_size=3))
def test_openai_chunk_template_wraps_a_choice_as_json_dumps_does(model, object_type, choice):
    envelope = Envelope("cmpl-0123", model)
    before, after = envelope.chunk_template(object_type)
    assert before + dumps(choice) + after == dumps(envelope.wrap(object_type, [choice]))
