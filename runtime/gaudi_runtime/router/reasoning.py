"""A reasoning model's thinking split from its answer (--reasoning-parser, vLLM's names).

DeepSeek-R1 and Qwen3 think between `<think>` and `</think>` before they answer. Where the output
starts depends on the prompt the chat template rendered:

- the prompt opened the thinking (DeepSeek-R1's template, Qwen3's 2507 thinking models end the
  prompt with `<think>`): the output starts inside it, with no `<think>` of its own;
- the prompt closed it (Qwen3's template with `chat_template_kwargs: {"enable_thinking": false}`
  renders an empty `<think></think>`): everything is the answer;
- neither: the output opens its thinking with `<think>` as its first token, or has none and is all
  answer (qwen3); deepseek_r1 takes the output before `</think>` as thinking even without `<think>`,
  as vLLM's parser does.

`Split` reads the output piece by piece, however the stream cuts it (inside `</think>` too): a
marker half-written at the end is held back until the next piece tells whether it is one. The
answer's leading whitespace after `</think>` is dropped. The shard's grammar waits for the same
`</think>` (shard/grammar.py ThinkingGate), from the start state decided here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gaudi_runtime.router.types import GrammarSpec

START, END = "<think>", "</think>"
MARKERS = (START, END)

THINKING, ANSWER, UNDECIDED = "thinking", "answer", "undecided"


def start_state(parser: str, prompt: str) -> str:
    """Where the output of `prompt` starts: THINKING, ANSWER or UNDECIDED (its first token tells)."""
    opened, closed = prompt.rfind(START), prompt.rfind(END)
    if opened > closed:
        return THINKING
    if closed >= 0 and not prompt[closed + len(END):].strip():
        return ANSWER
    return THINKING if parser == "deepseek_r1" else UNDECIDED


@dataclass(frozen=True)
class ThinkingTokens:
    """The served model's reasoning format: the parser's name and its markers' token ids."""

    parser: str
    start: int
    end: int


def thinking_tokens(parser: str | None, encode) -> ThinkingTokens | None:
    """The markers' ids (`encode`: text -> ids, no special tokens added); ValueError when the
    tokenizer does not hold each as one token (the shard's grammar gate waits for one token)."""
    if parser is None:
        return None
    ids = [encode(m) for m in (START, END)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"--reasoning-parser {parser}: the tokenizer does not hold {START} and {END} as single "
                         f"tokens (they encode as {ids[0]} and {ids[1]})")
    return ThinkingTokens(parser, ids[0][0], ids[1][0])


def gated(tokens: ThinkingTokens | None, prompt: str, grammar: GrammarSpec | None) -> GrammarSpec | None:
    """A constrained request's grammar told to wait for the end of the thinking, unless its prompt
    closed it: a reasoning model's grammar constrains the answer only."""
    if tokens is None or grammar is None:
        return grammar
    state = start_state(tokens.parser, prompt)
    if state == ANSWER:
        return grammar
    return replace(grammar, thinking=(tokens.start, tokens.end, state == THINKING))


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (a marker being written)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class Split:
    """One choice's output, split as it comes: `add` returns the (reasoning, answer) text it adds."""

    state: str
    pending: str = ""  # text not given out yet: a marker (or the answer's leading whitespace) maybe
    thought: bool = False  # some thinking was seen (the output opened or closed it)
    first: bool = True  # nothing read yet: a `<think>` here opens the thinking
    unstarted: bool = False  # after `</think>`, nothing but whitespace yet

    def add(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self.pending = self.pending + text, ""
        if self.first and self.state != ANSWER:
            head = buf.lstrip()
            if START.startswith(head) and not final and len(head) < len(START):
                self.pending = buf
                return "", ""
            self.first = False
            if head.startswith(START):
                self.state, self.thought, buf = THINKING, True, head[len(START):]
            elif self.state == UNDECIDED:
                self.state = ANSWER
        self.first = False
        if self.state == THINKING:
            return self._thinking(buf, final)
        return "", self._answer(buf, final)

    def _thinking(self, buf: str, final: bool) -> tuple[str, str]:
        self.thought = True
        k = buf.find(END)
        if k < 0:
            keep = 0 if final else _held_back(buf, END)
            self.pending = buf[len(buf) - keep:]
            return buf[:len(buf) - keep], ""
        self.state = ANSWER
        return buf[:k], self._answer(buf[k + len(END):].lstrip(), final, after_thinking=True)

    def _answer(self, buf: str, final: bool, after_thinking: bool = False) -> str:
        self.unstarted = self.unstarted or after_thinking
        if self.unstarted:
            buf = buf.lstrip()
            if not buf and not final:
                return ""  # the answer's first text is yet to come
        self.unstarted = False
        return buf


def split(parser_state: str, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, answer); reasoning None when the model did not think."""
    s = Split(parser_state)
    reasoning, answer = s.add(text, final=True)
    return (reasoning if s.thought else None), answer


@dataclass
class ReasoningStream:
    """The deltas of one choice's stream: its thinking as `reasoning`, its answer as `content`, or
    through `tools` (a tool_calls.ToolCallStream) when the answer may call tools."""

    split: Split
    tools: object | None = None

    def add(self, text: str, final: bool = False) -> list[dict]:
        reasoning, answer = self.split.add(text, final)
        out = [{"reasoning": reasoning}] if reasoning else []
        if self.tools is not None:
            return out + self.tools.add(answer, final)
        return out + ([{"content": answer}] if answer else [])

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called
