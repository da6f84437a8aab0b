"""A streamed response: the chat stream's deltas (text, tool-call pieces, reasoning) -> the Responses
API's events, in OpenAI's order.

    response.created, response.in_progress,
    per output item: response.output_item.added,
        a message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                     response.content_part.done
        reasoning:   response.reasoning_part.added, response.reasoning_text.delta..., .done, reasoning_part.done
        a call:      response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done; at the end response.completed (or response.incomplete at max_output_tokens).

Every event carries `sequence_number`, counted from 0. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from gaudi_runtime.router.responses_convert import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_text,
)


class _Open:
    """The output item being streamed: its kind, id, index and text (or arguments) so far."""

    def __init__(self, kind: str, item_id: str, index: int, call_id: str = "", name: str = ""):
        self.kind, self.id, self.index, self.call_id, self.name = kind, item_id, index, call_id, name
        self.text = ""


class ResponsesStream:
    def __init__(self, response: Callable[[list[dict], str, dict | None], dict]):
        """`response(output, status, usage)` renders the Response object around the items."""
        self.response = response
        self.seq = 0
        self.started = False
        self.output: list[dict] = []
        self.current: _Open | None = None

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        return [self._event(kind, response=self.response([], "in_progress", None))
                for kind in ("response.created", "response.in_progress")]

    def delta(self, delta: dict) -> list[dict]:
        """The events of one chat delta."""
        out = self.start()
        reasoning = reasoning_text(delta)
        if reasoning:
            out += self._text("reasoning", reasoning)
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def _open(self, kind: str, **extra) -> list[dict]:
        out = self._close()
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self.current = cur = _Open(kind, new_id(prefix), len(self.output), **extra)
        out.append(self._event("response.output_item.added", output_index=cur.index, item=self._item(cur, False)))
        if kind == "message":
            out.append(self._part_event("response.content_part.added", cur, ""))
        elif kind == "reasoning":
            out.append(self._part_event("response.reasoning_part.added", cur, ""))
        return out

    def _part_event(self, kind: str, cur: _Open, text: str) -> dict:
        part = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []} if cur.kind == "message"
                else {"type": "reasoning_text", "text": text})
        return self._event(kind, item_id=cur.id, output_index=cur.index, content_index=0, part=part)

    def _item(self, cur: _Open, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        if cur.kind == "message":
            return message_item(cur.id, cur.text, status)
        if cur.kind == "reasoning":
            return reasoning_item(cur.id, cur.text, status)
        return call_item(cur.id, cur.call_id, cur.name, cur.text if done else "", status)

    def _text(self, kind: str, text: str) -> list[dict]:
        out = [] if self.current is not None and self.current.kind == kind else self._open(kind)
        cur = self.current
        cur.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(name, item_id=cur.id, output_index=cur.index, content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict) -> list[dict]:
        function = call.get("function") or {}
        out = []
        if call.get("id") or self.current is None or self.current.kind != "function_call":
            out += self._open("function_call", call_id=call.get("id") or new_id("call"),
                              name=function.get("name", ""))
        cur = self.current
        piece = function.get("arguments") or ""
        if piece:
            cur.text += piece
            out.append(self._event("response.function_call_arguments.delta", item_id=cur.id,
                                   output_index=cur.index, delta=piece))
        return out

    def _close(self) -> list[dict]:
        cur, self.current = self.current, None
        if cur is None:
            return []
        out = []
        if cur.kind == "message":
            out.append(self._event("response.output_text.done", item_id=cur.id, output_index=cur.index,
                                   content_index=0, text=cur.text, logprobs=[]))
            out.append(self._part_event("response.content_part.done", cur, cur.text))
        elif cur.kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=cur.id, output_index=cur.index,
                                   content_index=0, text=cur.text))
            out.append(self._part_event("response.reasoning_part.done", cur, cur.text))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=cur.id,
                                   output_index=cur.index, name=cur.name, arguments=cur.text))
        item = self._item(cur, True)
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=cur.index, item=item))
        return out

    def finish(self, status: str, usage: dict | None) -> tuple[list[dict], dict]:
        """The events that end the stream, and the finished Response (to store)."""
        out = self.start() + self._close()
        final = self.response(self.output, status, usage)
        out.append(self._event(f"response.{status}", response=final))
        return out, final
