"""N-gram speculation (prompt lookup): each row's drafts for the next step, and when a row drafts at all.

A row's draft is what followed the latest earlier occurrence of its last n tokens (n from MAX_NGRAM
down to MIN_NGRAM) in its prompt and output so far. Text that repeats itself or its prompt (summaries,
code edits, answers quoting retrieved passages) is predicted well; other text rarely matches and then
drafts nothing. The runner verifies the drafts in one forward pass and keeps the longest prefix the
sampler agrees with, so drafts never change what a row generates: a rejected one only costs the extra
tokens of that pass. Hence the back-off:

- a batch of more than `max_rows` rows drafts nothing, nor one where fewer than half the rows have a
  draft: the pass computes every row's positions up to the longest draft, and costs about as much as
  one token per row only while the weights' reads dominate, that is for few tokens in all;
- a row whose draft was rejected outright skips the next 2, 4, ... MAX_SKIP steps, and starts over once
  a draft of it is accepted;
- a row never drafts past its max_new_tokens (the router reserved KV blocks for that many tokens), a
  row with a grammar never drafts (its matcher would have to check each draft token first), and with
  LongRoPE a row below the original length never drafts up to it (the window would be rotated long).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM = 4
MIN_NGRAM = 2
MAX_SKIP = 32


def ngram_draft(tokens: np.ndarray, k: int) -> np.ndarray:
    """`k` tokens that continue `tokens` as they went on after the latest earlier occurrence of their
    longest suffix (MAX_NGRAM down to MIN_NGRAM tokens long) found again in them; empty when none is.

    What followed that occurrence runs up to the end of `tokens`; past it, the same text again: a
    suffix found d tokens back says the text repeats with period d, as a looping output does."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # every n-gram that has a token after it
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start + np.arange(k) % (len(tokens) - start)]
    return tokens[:0]


@dataclass
class SpecStats:
    """A speculative step's drafts as vLLM counts them: rows that drafted, tokens drafted, drafts accepted,
    and accepted drafts by their place in the draft."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] | None = None

    @staticmethod
    def of(drafted: np.ndarray, emitted: list[list[int]], k: int) -> SpecStats:
        accepted = np.array([len(t) - 1 for t in emitted], dtype=np.int64)
        per_pos = [int((accepted > j).sum()) for j in range(k)]
        return SpecStats(int((drafted > 0).sum()), int(drafted.sum()), int(accepted.sum()), per_pos)


@dataclass
class RowTokens:
    """One row's prompt and output so far (its last token is the one the next step feeds), in a buffer
    sized for all it may hold; `limit`: the most tokens it may hold (prompt + max_new_tokens)."""

    buffer: np.ndarray
    n: int
    limit: int

    @staticmethod
    def of(prompt: Sequence[int], first: int, max_new_tokens: int) -> RowTokens:
        limit = len(prompt) + max_new_tokens
        buffer = np.empty(limit + 1, dtype=np.int64)  # + 1: a stale step past the budget (see `extend`)
        buffer[:len(prompt)] = prompt
        buffer[len(prompt)] = first
        return RowTokens(buffer, len(prompt) + 1, limit)

    def tokens(self) -> np.ndarray:
        return self.buffer[:self.n]

    def room(self) -> int:
        """Tokens the row may still generate."""
        return self.limit - self.n

    def extend(self, new: Sequence[int]) -> None:
        """Append the step's tokens; a call the router made before the row ended may still compute
        tokens past its budget, which are dropped here as the router drops them."""
        take = max(0, min(len(new), self.limit + 1 - self.n))
        self.buffer[self.n:self.n + take] = new[:take]
        self.n += take


def draft_rows(reqs, first: list[int], block_size: int) -> DraftRows:
    """A new batch's rows (`reqs`: PrefillInput) with their first tokens; a request that does not say its
    max_new_tokens may fill its blocks."""
    return DraftRows.of([RowTokens.of(r.input_ids, t, r.max_new_tokens or len(r.blocks) * block_size - len(r.input_ids))
                         for r, t in zip(reqs, first, strict=True)])


@dataclass
class DraftRows:
    """What speculation keeps per row of a batch (carried through `filter` and `concat` as the batch is)."""

    rows: list[RowTokens]
    skip: np.ndarray  # [B] steps left before the row drafts again
    fails: np.ndarray  # [B] drafts rejected outright in a row

    @staticmethod
    def of(rows: list[RowTokens]) -> DraftRows:
        n = len(rows)
        return DraftRows(rows, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    def filter(self, keep: Sequence[int]) -> DraftRows:
        return DraftRows([self.rows[i] for i in keep], self.skip[keep], self.fails[keep])

    @staticmethod
    def concat(parts: Sequence[DraftRows]) -> DraftRows:
        return DraftRows([r for p in parts for r in p.rows], np.concatenate([p.skip for p in parts]),
                         np.concatenate([p.fails for p in parts]))

    def plan(self, k: int, max_rows: int, constrained: Sequence[bool] = (),
             long_from: int | None = None) -> np.ndarray | None:
        """The step's tokens [B, k + 1]: each row's last token, then its drafts (-1 past them); None when
        the step should not speculate (a plain decode step then). `constrained`: the rows with a grammar
        (the sampler's; none when empty). `long_from`: LongRoPE's original length, which the window of a
        row below it stops before (its step there is a prefill again: router/batching.py)."""
        if len(self.rows) > max_rows:
            return None
        out = np.full((len(self.rows), k + 1), -1, dtype=np.int64)
        for i, row in enumerate(self.rows):
            tokens = row.tokens()
            out[i, 0] = tokens[-1]
            room = row.room() - 1  # the verify pass also gives a token after the drafts
            if long_from is not None and row.n <= long_from:
                room = min(room, long_from - row.n)
            if self.skip[i] > 0 or (constrained and constrained[i]) or room < 1:
                continue
            draft = ngram_draft(tokens, min(k, room))
            out[i, 1:1 + len(draft)] = draft
        self.skip = np.maximum(self.skip - 1, 0)
        drafting = int((out[:, 1] >= 0).sum())
        return out if drafting and 2 * drafting >= len(self.rows) else None

    def advance(self, new: list[list[int]], drafted: np.ndarray | None = None) -> None:
        """Record each row's tokens of the step (and, after a verify pass, back off the rows whose
        `drafted` tokens were all rejected: each emitted token after the first is an accepted draft)."""
        for row, tokens in zip(self.rows, new, strict=True):
            row.extend(tokens)
        if drafted is None:
            return
        accepted = np.array([len(t) - 1 for t in new], dtype=np.int64)
        rejected = (drafted > 0) & (accepted == 0)
        self.fails = np.where(rejected, self.fails + 1, np.where(accepted > 0, 0, self.fails))
        self.skip = np.where(rejected, np.minimum(2 ** self.fails, MAX_SKIP), self.skip)
