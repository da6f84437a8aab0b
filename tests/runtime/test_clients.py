"""The real clients users have, against the server at `server_url`.

Nothing here depends on the fake engine: the lead points the same tests at the real
server by overriding the `server_url` (and `server_api_key`) fixtures. Requests are
greedy, so streamed and non-streamed answers must agree.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPT = "the gaudi card serve request"
FINISH_TGI = {"length", "eos_token", "stop_sequence"}
FINISH_OPENAI = {"length", "stop"}


@pytest.fixture
def auth_headers(server_api_key) -> dict:
    return {"Authorization": f"Bearer {server_api_key}"} if server_api_key else {}


# --- text-generation (TGI's own Python client) ----------------------------------------------

def test_text_generation_client(server_url, auth_headers):
    from text_generation import Client

    client = Client(server_url, headers=auth_headers, timeout=60)
    r = client.generate(PROMPT, max_new_tokens=8, decoder_input_details=True)
    d = r.details
    assert d.finish_reason.value in FINISH_TGI
    assert 1 <= d.generated_tokens <= 8 and len(d.tokens) == d.generated_tokens
    assert len(d.prefill) > 0
    assert isinstance(r.generated_text, str)

    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert events[-1].details is not None and events[-1].generated_text == r.generated_text
    assert all(e.generated_text is None for e in events[:-1])
    assert [e.token.id for e in events] == [t.id for t in d.tokens]
    assert "".join(e.token.text for e in events if not e.token.special) == r.generated_text


def test_text_generation_client_top_tokens_and_sampling(server_url, auth_headers):
    from text_generation import Client

    client = Client(server_url, headers=auth_headers, timeout=60)
    r = client.generate(PROMPT, max_new_tokens=4, top_n_tokens=2, do_sample=True, seed=7)
    assert r.details.seed == 7
    assert len(r.details.top_tokens) == r.details.generated_tokens
    assert all(len(t) == 2 for t in r.details.top_tokens)
    r = client.generate(PROMPT, max_new_tokens=4, best_of=2, do_sample=True)
    assert len(r.details.best_of_sequences) == 1


def test_text_generation_client_errors(server_url, auth_headers):
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(server_url, headers=auth_headers, timeout=60)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.generate(PROMPT, max_new_tokens=10**6)
    with pytest.raises(ValidationError):
        list(client.generate_stream(PROMPT, max_new_tokens=10**6))
    assert client.generate(PROMPT, max_new_tokens=2).details.generated_tokens <= 2


async def test_text_generation_async_client(server_url, auth_headers):
    from text_generation import AsyncClient

    client = AsyncClient(server_url, headers=auth_headers, timeout=60)
    r = await client.generate(PROMPT, max_new_tokens=6)
    texts = [e.token.text async for e in client.generate_stream(PROMPT, max_new_tokens=6)
             if not e.token.special]
    assert "".join(texts) == r.generated_text


# --- huggingface_hub.InferenceClient ----------------------------------------------------------

@pytest.fixture
def hf_client(server_url, server_api_key):
    from huggingface_hub import InferenceClient

    return InferenceClient(base_url=server_url, api_key=server_api_key, timeout=60)


def test_inference_client_text_generation(hf_client):
    text = hf_client.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(text, str)
    out = hf_client.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert out.generated_text == text
    assert out.details.finish_reason in FINISH_TGI
    assert out.details.generated_tokens == len(out.details.tokens) <= 8

    pieces = list(hf_client.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert all(isinstance(p, str) for p in pieces)
    events = list(hf_client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events[-1].generated_text == text
    assert events[-1].details.generated_tokens == out.details.generated_tokens
    assert [e.token.id for e in events] == [t.id for t in out.details.tokens]


def test_inference_client_chat_completion(hf_client):
    messages = [{"role": "user", "content": "hello"}]
    out = hf_client.chat_completion(messages, max_tokens=6, temperature=0)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in FINISH_OPENAI
    assert out.usage.completion_tokens <= 6
    chunks = list(hf_client.chat_completion(messages, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_inference_client_errors(hf_client):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError):
        hf_client.text_generation(PROMPT, max_new_tokens=10**6)


# --- openai ------------------------------------------------------------------------------------

@pytest.fixture
def oai(server_url, server_api_key):
    import openai

    return openai.OpenAI(base_url=server_url + "/v1", api_key=server_api_key or "unused", timeout=60,
                         max_retries=0)


def test_openai_models(oai):
    models = oai.models.list()
    assert len(models.data) >= 1 and models.data[0].id


def test_openai_completions(oai):
    model = oai.models.list().data[0].id
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    (c,) = r.choices
    assert c.finish_reason in FINISH_OPENAI and isinstance(c.text, str)
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text

    r = oai.completions.create(model=model, prompt=[PROMPT, "hello world"], max_tokens=4, temperature=0)
    assert sorted(ch.index for ch in r.choices) == [0, 1]


def test_openai_chat(oai):
    model = oai.models.list().data[0].id
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason in FINISH_OPENAI
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_openai_errors(oai):
    import openai

    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=10**6)
    assert e.value.code == "context_length_exceeded" and e.value.type == "BadRequestError"
    with pytest.raises(openai.BadRequestError, match="client batch size"):
        oai.completions.create(model=model, prompt=[PROMPT] * 100, max_tokens=2)
