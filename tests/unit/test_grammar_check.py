"""The router asks the shards whether a grammar compiles: within --grammar-compile-timeout-s, once
per grammar text, the answer a 422 naming the field."""

from __future__ import annotations

import asyncio

import pytest

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.client import ShardError
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.grammar_check import ShardGrammars
from gaudi_runtime.router.types import GenerationError, GrammarSpec


class Shards:
    """compile_grammar as the shards answer it: an error for "bad", never for "slow", a failure for "dead"."""

    def __init__(self):
        self.calls: list[str] = []
        self.release = asyncio.Event()

    async def compile_grammar(self, grammar: pb.Grammar, timeout: float) -> pb.CompileGrammarResponse:
        self.calls.append(grammar.value)
        if grammar.value == "slow":
            await self.release.wait()
        if grammar.value == "dead":
            raise ShardError("CompileGrammar failed: UNAVAILABLE")
        await asyncio.sleep(0)
        return pb.CompileGrammarResponse(error="Regex parsing error" if grammar.value == "bad" else "")


async def test_answers_are_remembered_and_shared():
    shards = Shards()
    grammars = ShardGrammars(shards, timeout_s=5)
    ok = GrammarSpec("regex", "a+", "guided_regex")
    await asyncio.gather(*(grammars.check(ok) for _ in range(5)))  # at once: one call
    await grammars.check(ok)  # later: remembered
    assert shards.calls == ["a+"]
    for _ in range(2):
        with pytest.raises(ValidationError, match="^`response_format`: Regex parsing error$"):
            await grammars.check(GrammarSpec("regex", "bad", "response_format"))
    assert shards.calls == ["a+", "bad"]


async def test_a_compilation_past_the_time_limit_is_a_422_and_not_remembered():
    shards = Shards()
    grammars = ShardGrammars(shards, timeout_s=0.05)
    with pytest.raises(ValidationError, match=r"^`grammar`: compiling the grammar took longer than 0.05s"):
        await grammars.check(GrammarSpec("json", "slow"))
    shards.release.set()
    await grammars.check(GrammarSpec("json", "slow"))  # the shards finished it meanwhile
    assert shards.calls == ["slow", "slow"]


async def test_a_failing_shard_is_a_generation_error():
    with pytest.raises(GenerationError):
        await ShardGrammars(Shards(), timeout_s=1).check(GrammarSpec("json", "dead"))
