"""Whether a request's grammar compiles, asked of the shards before the request is queued.

The grammar engine (xgrammar) imports torch, which the router never loads, and compiles against
the model's vocabulary, which the shards hold: so the shards compile (each into its own cache, by
the grammar's text), and the router only waits for their answer, at most
`--grammar-compile-timeout-s`. A grammar that cannot compile, or not in time, is the request's
fault: a 422 naming the field it came from. Answers are remembered here by the grammar's text, and
requests that bring the same grammar at once share one call.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.types import GenerationError, GrammarSpec, ValidRequest


class ShardGrammars:
    def __init__(self, client: ShardClient, timeout_s: float, capacity: int = 1024):
        self.client = client
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._answers: OrderedDict[tuple[str, str], str] = OrderedDict()  # error text, "" when it compiles
        self._pending: dict[tuple[str, str], asyncio.Future] = {}

    async def check(self, grammar: GrammarSpec) -> None:
        """Returns once every shard holds the compiled grammar; else ValidationError naming the field."""
        key = (grammar.kind, grammar.value)
        error = self._answers.get(key)
        if error is None:
            error = await self._ask(key)
        if error:
            raise ValidationError(f"`{grammar.field}`: {error}")

    async def _ask(self, key: tuple[str, str]) -> str:
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._compile(key))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        # Shielded: one waiting client going away must not cancel the others' answer.
        return await asyncio.shield(pending)

    async def _compile(self, key: tuple[str, str]) -> str:
        call = self.client.compile_grammar(pb.Grammar(type=key[0], value=key[1]), timeout=self.timeout_s + 5)
        try:
            answer = await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            # Not remembered: the shards finish it in the background, and a later request finds it cached.
            return (f"compiling the grammar took longer than {self.timeout_s:g}s "
                    "(--grammar-compile-timeout-s); simplify it")
        except ShardError as e:
            raise GenerationError(str(e)) from e
        self._answers[key] = answer.error
        while len(self._answers) > self.capacity:
            self._answers.popitem(last=False)
        return answer.error


async def check_grammars(grammars: ShardGrammars | None, requests: list[ValidRequest]) -> None:
    """Every distinct grammar of `requests` compiled (a server without shards to ask, as in tests
    over a fake engine, checks nothing)."""
    if grammars is None:
        return
    for spec in dict.fromkeys(r.grammar for r in requests if r.grammar is not None):
        await grammars.check(spec)
