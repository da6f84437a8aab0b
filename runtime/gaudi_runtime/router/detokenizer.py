"""Token-by-token text for streaming, and stop-sequence matching.

`IncrementalDetokenizer` follows TGI's prefix/read offset method: decode a short
window of ids ending at the new one and emit only what the new id added; when the
window decodes to a trailing U+FFFD the id completes no character yet, so nothing is
emitted until a later id does. Concatenating every `add` (plus `flush`) equals
`tokenizer.decode(ids)`.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt ids decoded ahead of the first generated one


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int] | None = None):
        """`prompt_ids` (last few used) give the decoder context, as TGI does, so that a
        first generated token decodes the same as it would after the prompt."""
        self._tok = tokenizer
        ctx = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self._ids: list[int] = ctx
        self._n_context = len(ctx)
        self._prefix = 0
        self._read = len(ctx)
        self._pieces: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Generated ids so far (without the prompt context)."""
        return self._ids[self._n_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (maybe "")."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            out = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self._pieces.append(out)
            return out
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (maybe ending in U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        out = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        if out:
            self._pieces.append(out)
        return out


class StopSequenceMatcher:
    """Does the generated text contain one of the stop sequences?

    `check` is called with the full generated text after each token; a stop sequence
    that ends inside a token's text (not only at the very end) matches too.
    """

    def __init__(self, stop_sequences: list[str] | tuple[str, ...]):
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self._longest = max((len(s) for s in self.stop_sequences), default=0)
        self._checked = 0  # text length already searched
        self.matched: str | None = None

    def check(self, text: str) -> bool:
        if self.matched is not None:
            return True
        if not self.stop_sequences:
            return False
        start = max(0, self._checked - self._longest + 1)
        window = text[start:]
        self._checked = len(text)
        for s in self.stop_sequences:
            if s in window:
                self.matched = s
                return True
        return False
