"""Grammar-constrained decoding on the shard: grammars compiled by xgrammar, and the token masks
of a batch's constrained rows.

A grammar (a JSON schema, a regular expression or an xgrammar structural tag) is compiled once
against the model's vocabulary and kept under the id the router gave it, until the router forgets it. Each constrained row of a
batch has a matcher, which knows the tokens it may take next; before each step the matchers fill a
bitmask of the batch (one bit per vocabulary entry, `ceil(V / 32)` int32 words per row, the same
shape every step of a bucket), the sampler sets the logits of the tokens it forbids to -inf, and
after the step every matcher accepts the token its row took. Rows without a grammar have every bit
set. Every rank runs the same matchers on the same tokens, so they mask alike.

A reasoning model's grammar constrains its answer only: its matcher waits behind a `ThinkingGate`
until the thinking has ended (the router says which tokens open and close it, and whether the
prompt opened it).

xgrammar imports torch: only the shards import this module, never the router.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

KINDS = ("json", "regex", "structural_tag")
_BITS = 32


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why, in the user's terms."""


def error_message(e: Exception) -> str:
    """xgrammar's error without its log prefix (`[12:00:00] /path/file.cc:42: `)."""
    text = str(e).strip()
    text = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text).strip() or type(e).__name__


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + _BITS - 1) // _BITS


@dataclass
class Compiled:
    grammar: object  # xgrammar.CompiledGrammar
    compile_ns: int


class GrammarCache:
    """Compiled grammars by the id the router gave each: a grammar's text crosses to the shard once,
    in the CompileGrammar that compiles it, and its prefills name the id. An entry stays until the
    router forgets it (it knows which grammars its live requests use), so a prefill always finds its
    grammar. A grammar that fails to compile is not kept: the router remembers the error.

    Thread-safe: compilation runs in a worker thread while the shard's loop serves steps."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int], forgotten_kept: int = 1024):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiled: dict[int, Compiled] = {}
        # Forgotten ids that were not here: compilations the router stopped waiting for may still be
        # queued or running, and must not be kept when they end. Ids are never reused, and the router
        # gives up on few compilations, so the oldest may go.
        self._forgotten: OrderedDict[int, None] = OrderedDict()
        self._forgotten_kept = forgotten_kept
        self._lock = threading.Lock()
        self._compiler = None
        self._batch_matcher = None
        self.compilations = 0  # grammars compiled since start (a reused one is not compiled again)

    def prepare(self) -> None:
        """Load the grammar engine and read the vocabulary now (at warmup), so that the first
        grammar's compilation is only that; without it, as when xgrammar is missing, grammars fail
        when used."""
        try:
            self._xgr_compiler()
        except ImportError as e:
            log.warning("grammars cannot be served: %s", e)

    def _xgr_compiler(self):
        """The compiler over the model's vocabulary, built once."""
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._batch_matcher = xgr.BatchGrammarMatcher()
        return self._compiler

    def compile(self, grammar_id: int, kind: str, value: str) -> Compiled:
        """The grammar compiled and kept under `grammar_id` (already there: as it is), or GrammarError."""
        with self._lock:
            found = self._compiled.get(grammar_id)
        if found is not None:
            return found
        found = self._compile(kind, value)
        if isinstance(found, str):
            raise GrammarError(found)
        with self._lock:
            self.compilations += 1
            if grammar_id not in self._forgotten:
                self._compiled[grammar_id] = found
        return found

    def cached(self, grammar_id: int) -> bool:
        with self._lock:
            return grammar_id in self._compiled

    def forget(self, ids: Sequence[int]) -> None:
        """Drop these grammars: no request the router holds uses them."""
        with self._lock:
            for i in ids:
                if self._compiled.pop(i, None) is None:
                    self._forgotten[i] = None
                    while len(self._forgotten) > self._forgotten_kept:
                        self._forgotten.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)

    def _compile(self, kind: str, value: str) -> Compiled | str:
        if kind not in KINDS:
            return f"unknown grammar type {kind!r}"
        try:
            compiler = self._xgr_compiler()
        except ImportError as e:
            return f"grammar support needs the xgrammar package on the shards ({e})"
        t0 = time.perf_counter_ns()
        try:
            if kind == "json":
                # One line, `json.dumps` spacing: whitespace the model could repeat forever is not offered.
                grammar = compiler.compile_json_schema(bounded_strings(value), any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(value)
            else:
                grammar = compiler.compile_structural_tag(bounded_strings(value))
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError, TypeError) on bad input
            return error_message(e)
        return Compiled(grammar, time.perf_counter_ns() - t0)

    def matcher(self, grammar_id: int):
        """A new matcher of the grammar kept under `grammar_id`; GrammarError when it is not kept."""
        import xgrammar as xgr

        with self._lock:
            found = self._compiled.get(grammar_id)
        if found is None:
            raise GrammarError(f"grammar {grammar_id} was not compiled on this shard (or was forgotten)")
        return xgr.GrammarMatcher(found.grammar)

    def fill(self, matchers: list, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Fill the rows `indices` of `bitmask` from `matchers` (xgrammar's threads when several)."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, indices[0])
        else:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices)


# One JSON string character, not quote, backslash or control: a code point range per UTF-8 length
# and lead byte, each a class of its own (xgrammar's JSON-string patterns merge the ranges of one
# class byte by byte, which lets overlong encodings through; one range per class keeps them out).
_JSON_CHAR = "(" + "|".join(f"[{r}]" for r in (
    r"\x20-\x21\x23-\x5b\x5d-\x7f", r"\u0080-\u07ff", r"\u0800-\u0fff", r"\u1000-\ucfff", r"\ud000-\ud7ff",
    r"\ue000-\uffff", r"\u{10000}-\u{3ffff}", r"\u{40000}-\u{fffff}", r"\u{100000}-\u{10ffff}")) + ")"


def bounded_strings(text: str) -> str:
    """The schema (or structural tag) with each string's length bounds written as a pattern instead.

    xgrammar's own rule for `minLength`/`maxLength` lets raw control characters into the string
    (invalid JSON) and no escapes; a pattern of valid characters (no quote, backslash, control,
    surrogate or overlong encoding: what UTF-8 decoders take as one character) keeps every output
    valid JSON that follows the schema as given."""
    try:
        node = json.loads(text)
    except ValueError:
        return text  # xgrammar reports it
    return json.dumps(_bound(node), ensure_ascii=False)


def _bound(node):
    if isinstance(node, list):
        return [_bound(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bound(v) for k, v in node.items()}
    lo, hi = node.get("minLength"), node.get("maxLength")
    if node.get("type") == "string" and "pattern" not in node and (lo is not None or hi is not None):
        if all(v is None or isinstance(v, int) and v >= 0 for v in (lo, hi)):
            upper = "" if hi is None else hi
            node["pattern"] = f"^{_JSON_CHAR}{{{lo or 0},{upper}}}$"
            node.pop("minLength", None), node.pop("maxLength", None)  # in the pattern; xgrammar would ignore them
    return node


class ThinkingGate:
    """The matcher of a reasoning model's answer: while the model thinks, every token is allowed and
    the grammar sees none; from the token after the one that ends the thinking (`end`, one token in
    these tokenizers), the grammar's matcher decides. `open`: the prompt opened the thinking; else the
    output may open it with `start` as its first token (allowed beside the grammar's first tokens),
    and any other first token is the answer's."""

    def __init__(self, matcher, start: int, end: int, open: bool):
        self.matcher = matcher
        self.start, self.end = start, end
        self.thinking = open
        self.first = not open  # the first token is still to come and may open the thinking

    def accept_token(self, token: int) -> bool:
        first, self.first = self.first, False
        if first and token == self.start:
            self.thinking = True
            return True
        if self.thinking:
            self.thinking = token != self.end
            return True
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return not self.thinking and self.matcher.is_terminated()


class GrammarRows:
    """The matchers of a batch's rows (None: the row is unconstrained) and the host bitmask they
    fill. A row whose matcher has ended (it took a stop token, or a step computed after the router
    had finished the request) may take only a stop token."""

    def __init__(self, cache: GrammarCache, matchers: list):
        self.cache = cache
        self.matchers = matchers
        self.words = bitmask_words(cache.vocab_size)
        self._host: torch.Tensor | None = None
        self._ended_row = torch.zeros(self.words, dtype=torch.int32)
        for t in cache.stop_token_ids:
            if 0 <= t < cache.vocab_size:
                self._ended_row[t // _BITS] |= _int32_bit(t % _BITS)

    def __len__(self) -> int:
        return len(self.matchers)

    def filter(self, keep: Sequence[int]) -> GrammarRows | None:
        return GrammarRows.of(self.cache, [self.matchers[i] for i in keep])

    @staticmethod
    def of(cache: GrammarCache | None, matchers: list) -> GrammarRows | None:
        """Rows with these matchers, or None when no row is constrained (nothing to mask)."""
        if cache is None or all(m is None for m in matchers):
            return None
        return GrammarRows(cache, matchers)

    @staticmethod
    def concat(parts: Sequence[tuple[GrammarRows | None, int]]) -> GrammarRows | None:
        """Rows of (grammar rows or None, row count) parts, in order."""
        cache = next((g.cache for g, _ in parts if g is not None), None)
        matchers = [m for g, n in parts for m in (g.matchers if g is not None else [None] * n)]
        return GrammarRows.of(cache, matchers)

    def fill(self, rows: int) -> torch.Tensor:
        """The bitmask [rows, words] int32 (rows >= the batch: padding rows allow everything)."""
        if self._host is None or self._host.shape[0] < rows:
            self._host = torch.empty((rows, self.words), dtype=torch.int32)
        mask = self._host[:rows]
        mask.fill_(-1)
        live, indices, opening = [], [], []
        for i, m in enumerate(self.matchers):
            if isinstance(m, ThinkingGate):
                if m.thinking:
                    continue  # a row that thinks is free
                if m.first:
                    opening.append((i, m.start))
                m = m.matcher
            if m is None:
                continue
            if m.is_terminated():
                mask[i] = self._ended_row
            else:
                live.append(m)
                indices.append(i)
        if live:
            self.cache.fill(live, mask, indices)
        for i, t in opening:
            mask[i, t // _BITS] |= _int32_bit(t % _BITS)
        return mask

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance each constrained row's matcher by the token its row took."""
        for m, t in zip(self.matchers, tokens, strict=False):
            if m is not None and not m.is_terminated():
                m.accept_token(int(t))  # False only for a step past the end: the row then ends


def _int32_bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits int32 (bit 31 is negative)."""
    return -(1 << 31) if k == 31 else 1 << k


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [B, V] from a bitmask [B, ceil(V / 32)] int32: fixed-shape tensor code, no host sync."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
