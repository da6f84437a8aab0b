"""A grammar's text crosses to the shards once: the CompileGrammar that compiles it; the prefills of
every request using it name its id. The router forgets a grammar nobody holds once it keeps more than
its table's capacity, the shard drops it, and a later request bringing it again has it compiled
again under a new id, with an output that follows it.

One CPU shard served in this process (real gRPC), the router's engine in front of it; every call's
bytes are read on their way out."""

from __future__ import annotations

import asyncio
import json

import pytest

from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router.client import ShardClient
from gaudi_runtime.router.types import GrammarSpec, StoppingParameters, ValidRequest
from gaudi_runtime.shard.runner import ModelRunner
from tests.runtime.test_warmup import config, model_dir, serve_in_process  # noqa: F401 (a fixture)

SCHEMA = json.dumps({"type": "object", "additionalProperties": False, "required": ["a"],
                     "properties": {"a": {"enum": ["x", "y"]}}}, separators=(",", ":"))
REGEX = "[0-9]{2,4}"


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, bytes]]:
    """Every (method, serialized request) the router's client sends."""
    calls: list[tuple[str, bytes]] = []
    send = ShardClient._all

    async def recorded(self, method: str, request, *args, **kw):
        calls.append((method, request.SerializeToString()))
        return await send(self, method, request, *args, **kw)

    monkeypatch.setattr(ShardClient, "_all", recorded)
    return calls


def _crossings(sent: list[tuple[str, bytes]], text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for method, body in sent:
        out[method] = out.get(method, 0) + body.count(text.encode())
    return {m: n for m, n in out.items() if n}


async def _generate(engine, grammar: GrammarSpec, seed: int) -> str:
    req = ValidRequest(input_ids=[5, 6, 7 + seed % 50], inputs="", grammar=grammar,
                       sampling=SamplingParameters(do_sample=True, seed=seed),
                       stopping=StoppingParameters(max_new_tokens=40))
    await engine.check_grammars([req])  # as the HTTP layer admits it
    return "".join([ev.token.text async for ev in engine.generate(req) if not ev.token.special])  # EOS: special


def test_a_grammar_crosses_once_and_comes_back_after_it_was_forgotten(model_dir, tmp_path, sent):  # noqa: F811
    cfg = config(model_dir, DEVICE="cpu")
    runner = ModelRunner(cfg, str(model_dir), CpuBackend())
    outputs: dict[str, list[str]] = {}
    schema, regex = GrammarSpec("json", SCHEMA, "response_format"), GrammarSpec("regex", REGEX, "guided_regex")

    async def traffic(engine):
        engine.requests.grammars.capacity = 1  # one grammar kept besides those live requests hold
        outputs["first"] = await asyncio.gather(*(_generate(engine, schema, s) for s in range(6)))
        assert _crossings(sent, SCHEMA) == {"CompileGrammar": 1}
        assert runner.grammars.compilations == 1
        outputs["regex"] = await asyncio.gather(*(_generate(engine, regex, s) for s in range(3)))
        assert len(runner.grammars) == 1  # the schema was forgotten with the regex's first prefill
        outputs["again"] = await asyncio.gather(*(_generate(engine, schema, s) for s in range(3)))
        assert _crossings(sent, SCHEMA) == {"CompileGrammar": 2}
        assert _crossings(sent, REGEX) == {"CompileGrammar": 1}
        assert runner.grammars.compilations == 3

    asyncio.run(serve_in_process(runner, cfg, model_dir, str(tmp_path / "shard"), traffic))
    for text in outputs["first"] + outputs["again"]:
        assert json.loads(text)["a"] in ("x", "y")
    for text in outputs["regex"]:
        assert text.isdigit() and 2 <= len(text) <= 4
