"""Stored responses (`store: true`, the default): what `GET /v1/responses/{id}` answers and what
`previous_response_id` continues from, held in memory, the most recent `capacity` of them.

Each entry keeps the Response and the conversation up to and including its output (as chat
messages), so a next turn is that conversation plus its own input: no walk back along the chain,
and evicting an old response never breaks a newer one that continued from it. An id asked for after
its eviction gets an error that says so (the ids evicted lately are remembered, not their bodies).
Like vLLM's, the store lives in the router's memory: a restart, or another replica, does not have it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from gaudi_runtime.router.openai_errors import OpenAIRequestError

CAPACITY = 1024  # responses kept; each holds its conversation's text


@dataclass(frozen=True)
class Stored:
    response: dict
    conversation: list[dict]  # chat messages: every turn's input and output, instructions left out


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, conversation: list[dict]) -> None:
        self._items[rid] = Stored(response, conversation)
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            self._evicted[old] = None
            while len(self._evicted) > 16 * self.capacity:
                self._evicted.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> Stored:
        """The stored response, or OpenAI's 404 saying whether it was evicted or never stored."""
        found = self._items.get(rid)
        if found is not None:
            return found
        if rid in self._evicted:
            raise OpenAIRequestError(
                404, f"Response with id '{rid}' was evicted: this server keeps only its {self.capacity} most "
                     "recent stored responses in memory; send the whole conversation as `input` instead",
                param=param, code="previous_response_not_found" if param == "previous_response_id" else None)
        raise OpenAIRequestError(404, f"Response with id '{rid}' not found (it was stored with `store: false`, "
                                      "deleted, or made before the server started)", param=param,
                                 code="previous_response_not_found" if param == "previous_response_id" else None)

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]


RESPONSES = web.AppKey("gaudi_serve_responses", ResponseStore)


def get_store(request: web.Request) -> ResponseStore:
    return request.app[RESPONSES]
