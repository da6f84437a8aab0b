"""The grammars the shards keep compiled, as the router tracks them (pure).

A grammar's text crosses to the shards once: a CompileGrammar gives it an id (the router's, never
reused), and each prefill of a request constrained by it names only the id. The shards keep a
compiled grammar until the router forgets it, so the router decides what they keep: every grammar a
live request holds (from its admission to its end), and at most `capacity` more, the most recently
used. A forgotten id travels on the next prefill (`take_forgotten`), a numbered call made after
every call that could name it, so the shards drop it only once those have run.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

GrammarKey = tuple[str, str]  # (kind, text)


@dataclass
class _Entry:
    id: int
    ready: bool  # False: the router stopped waiting for its compilation (the shards may finish it)
    holds: int = 0  # live requests using it


class GrammarTable:
    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._entries: OrderedDict[GrammarKey, _Entry] = OrderedDict()  # least recently used first
        self._keys: dict[int, GrammarKey] = {}
        self._forgotten: list[int] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def ready(self, key: GrammarKey) -> int | None:
        """The id under which the shards hold `key` compiled (now its most recent use), or None."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            return None
        self._entries.move_to_end(key)
        return entry.id

    def id_for(self, key: GrammarKey) -> int:
        """The id to compile `key` under: the one it was asked under before (a compilation the router
        stopped waiting for, which the shards may have finished since), else a new one."""
        entry = self._entries.get(key)
        return entry.id if entry is not None else next(self._ids)

    def compiled(self, key: GrammarKey, grammar_id: int, ready: bool, busy: Collection[GrammarKey] = ()) -> None:
        """The shards answered (ready) or may still be compiling (not ready) `key` under `grammar_id`;
        past capacity, the least recently used grammars nobody holds and none of `busy` (being
        compiled again) are forgotten."""
        self._entries[key] = _Entry(grammar_id, ready, self._entries[key].holds if key in self._entries else 0)
        self._entries.move_to_end(key)
        self._keys[grammar_id] = key
        excess = len(self._entries) - self.capacity
        if excess > 0:
            unheld = [k for k, e in self._entries.items() if e.holds == 0 and k not in busy and k != key]
            for k in unheld[:excess]:  # least recently used first
                self.forget(k)

    def forget(self, key: GrammarKey) -> None:
        """The shards may drop `key` (a grammar nobody holds, or one that failed to compile)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            del self._keys[entry.id]
            self._forgotten.append(entry.id)

    def hold(self, grammar_id: int) -> None:
        """A request admitted now uses `grammar_id` (from `ready`, with no await in between)."""
        self._entries[self._keys[grammar_id]].holds += 1

    def release(self, grammar_id: int) -> None:
        """A request that held `grammar_id` ended: no call made from now on names it for that request."""
        self._entries[self._keys[grammar_id]].holds -= 1

    def take_forgotten(self) -> list[int]:
        """The ids forgotten since the last call, for the next prefill to carry."""
        out, self._forgotten = self._forgotten, []
        return out
