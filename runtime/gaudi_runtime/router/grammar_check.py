"""Whether a request's grammar compiles, asked of the shards before the request is queued.

The grammar engine (xgrammar) imports torch, which the router never loads, and compiles against
the model's vocabulary, which the shards hold: so the shards compile, each keeping the result under
the id the router gives it (router/grammar_table.py), and the router only waits for their answer,
at most `--grammar-compile-timeout-s`. That call is the only one carrying the grammar's text: a
grammar the shards hold is not sent again, and prefills name its id. A grammar that cannot compile,
or not in time, is the request's fault: a 422 naming the field it came from. Failures are remembered
here by the grammar's text, and requests that bring the same grammar at once share one call.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.grammar_table import GrammarKey, GrammarTable
from gaudi_runtime.router.types import GenerationError, GrammarSpec, ValidRequest


class ShardGrammars:
    def __init__(self, client: ShardClient, timeout_s: float, table: GrammarTable | None = None,
                 failures_kept: int = 1024):
        self.client = client
        self.timeout_s = timeout_s
        self.table = table if table is not None else GrammarTable()
        self.failures_kept = failures_kept
        self._failed: OrderedDict[GrammarKey, str] = OrderedDict()  # why each failed to compile
        self._pending: dict[GrammarKey, asyncio.Future] = {}

    async def check(self, grammar: GrammarSpec) -> None:
        """Returns once every shard holds the compiled grammar; else ValidationError naming the field."""
        key = (grammar.kind, grammar.value)
        if self.table.ready(key) is not None:
            return
        error = self._failed.get(key)
        if error is None:
            error = await self._ask(key)
        if error:
            raise ValidationError(f"`{grammar.field}`: {error}")

    async def compiled_id(self, grammar: GrammarSpec) -> int:
        """The id the shards hold `grammar` under, compiled first if they do not (it was never checked,
        or forgotten since its check). No await separates the answer from the caller's next step, so a
        request holds it (`GrammarTable.hold`) before anything can forget it."""
        key = (grammar.kind, grammar.value)
        while (grammar_id := self.table.ready(key)) is None:
            await self.check(grammar)
        return grammar_id

    async def _ask(self, key: GrammarKey) -> str:
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._compile(key))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        # Shielded: one waiting client going away must not cancel the others' answer.
        return await asyncio.shield(pending)

    async def _compile(self, key: GrammarKey) -> str:
        grammar_id = self.table.id_for(key)
        call = self.client.compile_grammar(key[0], key[1], grammar_id, timeout=self.timeout_s + 5)
        try:
            answer = await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            # Kept unready under its id: the shards finish it in the background, and a later request
            # asks again under the same id and finds it there.
            self.table.compiled(key, grammar_id, ready=False, busy=self._pending.keys())
            return (f"compiling the grammar took longer than {self.timeout_s:g}s "
                    "(--grammar-compile-timeout-s); simplify it")
        except ShardError as e:
            raise GenerationError(str(e)) from e
        if answer.error:
            self.table.forget(key)  # asked before under this id and given up on: nothing to keep
            self._failed[key] = answer.error
            while len(self._failed) > self.failures_kept:
                self._failed.popitem(last=False)
        else:
            self.table.compiled(key, grammar_id, ready=True, busy=self._pending.keys())
        return answer.error


async def check_grammars(grammars: ShardGrammars | None, requests: list[ValidRequest]) -> None:
    """Every distinct grammar of `requests` compiled (a server without shards to ask, as in tests
    over a fake engine, checks nothing)."""
    if grammars is None:
        return
    for spec in dict.fromkeys(r.grammar for r in requests if r.grammar is not None):
        await grammars.check(spec)
