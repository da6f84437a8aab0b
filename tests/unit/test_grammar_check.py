"""The router asks the shards whether a grammar compiles: within --grammar-compile-timeout-s, once
per grammar text, the answer a 422 naming the field; the shards keep what compiled under an id until
the router forgets it, which it does only for grammars no live request holds."""

from __future__ import annotations

import asyncio

import pytest

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.client import ShardError
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.grammar_check import ShardGrammars
from gaudi_runtime.router.grammar_table import GrammarTable
from gaudi_runtime.router.types import GenerationError, GrammarSpec


class Shards:
    """compile_grammar as the shards answer it: an error for "bad", never for "slow", a failure for "dead"."""

    def __init__(self):
        self.calls: list[str] = []
        self.ids: list[int] = []
        self.release = asyncio.Event()

    async def compile_grammar(self, kind: str, value: str, grammar_id: int, timeout: float) -> pb.CompileGrammarResponse:
        self.calls.append(value)
        self.ids.append(grammar_id)
        if value == "slow":
            await self.release.wait()
        if value == "dead":
            raise ShardError("CompileGrammar failed: UNAVAILABLE")
        await asyncio.sleep(0)
        return pb.CompileGrammarResponse(error="Regex parsing error" if value == "bad" else "")


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
    assert shards.ids[0] == shards.ids[1]  # asked again under the id it may already be kept under


async def test_a_failing_shard_is_a_generation_error():
    with pytest.raises(GenerationError):
        await ShardGrammars(Shards(), timeout_s=1).check(GrammarSpec("json", "dead"))


def test_the_table_forgets_only_the_least_recently_used_grammars_nobody_holds():
    table = GrammarTable(capacity=2)
    a, b, c, d = (("regex", x) for x in "abcd")
    ids = {}
    for key in (a, b):
        ids[key] = table.id_for(key)
        table.compiled(key, ids[key], ready=True)
    table.hold(table.ready(a))  # a request runs under a
    table.ready(b)
    ids[c] = table.id_for(c)
    table.compiled(c, ids[c], ready=True)  # past capacity: b is the only one nobody holds
    assert table.take_forgotten() == [ids[b]] and table.ready(b) is None
    ids[d] = table.id_for(d)
    table.compiled(d, ids[d], ready=True, busy=[c])  # c is being compiled again: kept; a is held
    assert table.take_forgotten() == [] and len(table) == 3
    table.release(ids[a])
    again = table.id_for(b)
    table.compiled(b, again, ready=True)  # b is back under a new id; a and c, held by nobody, go
    assert again not in ids.values()
    assert sorted(table.take_forgotten()) == sorted([ids[a], ids[c]])
    assert table.take_forgotten() == []  # each forgotten id travels once


async def test_a_grammar_is_compiled_again_under_a_new_id_once_forgotten():
    shards = Shards()
    grammars = ShardGrammars(shards, timeout_s=5, table=GrammarTable(capacity=1))
    first = await grammars.compiled_id(GrammarSpec("regex", "a+"))
    assert await grammars.compiled_id(GrammarSpec("regex", "a+")) == first and shards.calls == ["a+"]
    await grammars.check(GrammarSpec("regex", "b+"))
    assert grammars.table.take_forgotten() == [first]
    again = await grammars.compiled_id(GrammarSpec("regex", "a+"))
    assert again != first and shards.calls == ["a+", "b+", "a+"]
