"""Tokens that reach a stream several at a time (a decode call of several steps) still reach the
client one event per token, in order, each with the text it completes: the real engine, over
scripted shards that answer a fixed text whose characters span several byte tokens, and the
clients users have."""

from __future__ import annotations

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.engine import BatchingEngine
from gaudi_runtime.router.server import build_app
from tests.runtime.conftest import SERVER_ENV
from tests.runtime.fake_engine import ServerThread
from tests.unit.scripted_shards import ScriptedShards

pytestmark = pytest.mark.slow

TEXT = "東京 😀 🎉 日本語 Ωμέγα ñandú 🦀"
DECODE_STEPS = 4


class TextShards(ScriptedShards):
    """Every request generates the same token ids, whatever its prompt."""

    def __init__(self, script: list[int], eos_id: int):
        super().__init__(eos_id, {})
        self.script = script

    def _tokens(self, ids: list[int]) -> pb.Generations:
        out = []
        for rid in ids:
            n = self.generated[rid] = self.generated.get(rid, 0) + 1
            out.append(self.script[(n - 1) % len(self.script)])
            self.sequences[rid].append(out[-1])
        return pb.Generations(request_ids=ids, token_ids=out, logprobs=[-0.5] * len(ids))


@pytest.fixture(scope="module")
def script(router_tokenizer) -> list[int]:
    ids = router_tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in router_tokenizer.decode([i]) for i in ids)  # characters split across tokens
    return ids


@pytest.fixture(scope="module")
def served(tiny_model_dir, router_tokenizer, script):
    config = resolve(None, {"MODEL_ID": tiny_model_dir, **SERVER_ENV, "DECODE_STEPS": str(DECODE_STEPS)})
    shards = TextShards(script, router_tokenizer.eos_token_id)
    engine = shards.engine = BatchingEngine(config, shards, router_tokenizer)
    app = build_app(config, engine, router_tokenizer)

    async def start_engine(_app):
        await engine.start()

    async def stop_engine(_app):
        await engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    thread = ServerThread(app).start()
    yield thread.url, shards
    thread.stop()


def _check_pieces(pieces: list[str], n_tokens: int) -> None:
    """One piece per token, whole characters only, adding up to the text; some tokens complete none."""
    assert len(pieces) == n_tokens
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces and " 🎉" in pieces  # the bytes of 🎉 held back until the last of them


def test_tgi_client_gets_every_token_of_a_multi_step_call(served, script):
    from text_generation import Client

    url, shards = served
    events = list(Client(url, timeout=60).generate_stream("hello", max_new_tokens=len(script)))
    assert [e.token.id for e in events] == script
    _check_pieces([e.token.text for e in events], len(script))
    assert events[-1].generated_text == TEXT and events[-1].details.finish_reason.value == "length"
    assert all(e.generated_text is None for e in events[:-1])
    assert max(steps for _, _, steps, _ in shards.decodes) == DECODE_STEPS  # tokens came several per call


def test_openai_clients_get_every_token_of_a_multi_step_call(served, script):
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    chunks = list(client.completions.create(model="tiny-llama", prompt="hello", max_tokens=len(script),
                                            stream=True, logprobs=1))
    _check_pieces([c.choices[0].text for c in chunks], len(script))
    assert [c.choices[0].logprobs.tokens[0] for c in chunks] == [c.choices[0].text for c in chunks]
    assert chunks[-1].choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=len(script), stream=True))
    _check_pieces([c.choices[0].delta.content for c in chunks], len(script))

    texts: dict[int, list[str]] = {0: [], 1: []}  # two choices: their tokens interleave on one stream
    for c in client.completions.create(model="tiny-llama", prompt="hello", max_tokens=len(script), n=2,
                                       stream=True):
        texts[c.choices[0].index].append(c.choices[0].text)
    for pieces in texts.values():
        _check_pieces(pieces, len(script))
