"""Traffic shapes for `gaudi-serve loadtest` (pure): length distributions, arrival schedules, prompts.

Length distributions are written as short specs on the command line:

    128                    always 128
    uniform:16:256         uniform integer in [16, 256]
    normal:200:50          normal(mean 200, sd 50), rounded
    lognormal:180:0.9      log-normal with median 180 and log-space sigma 0.9
    choice:8,8,200         one of the listed values, uniformly
    chat-prompt            the shipped chat histogram of prompt lengths
    chat-output            the shipped chat histogram of output lengths

Every sample is an integer clipped to [1, cap] (cap: --max-prompt-tokens or
--max-output-tokens).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

# Chat histograms, shipped with the tool: (low, high, weight) buckets in tokens, sampled
# uniformly inside a bucket. They are long-tailed the way multi-turn chat traffic is (most
# turns are short, a few carry long pasted context or long answers). They are our own
# choice of shape, not measurements of a particular dataset: medians ~ 170 prompt tokens
# and ~ 200 output tokens.
CHAT_PROMPT_HISTOGRAM: tuple[tuple[int, int, float], ...] = (
    (4, 16, 0.06), (17, 32, 0.08), (33, 64, 0.11), (65, 128, 0.15), (129, 256, 0.20),
    (257, 512, 0.18), (513, 1024, 0.13), (1025, 2048, 0.07), (2049, 4096, 0.02),
)
CHAT_OUTPUT_HISTOGRAM: tuple[tuple[int, int, float], ...] = (
    (1, 16, 0.05), (17, 64, 0.12), (65, 128, 0.16), (129, 256, 0.24), (257, 384, 0.18),
    (385, 512, 0.12), (513, 768, 0.08), (769, 1024, 0.05),
)


class LengthSpecError(ValueError):
    pass


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; `sample(rng)` draws one (>= 1, <= cap)."""

    spec: str
    kind: str
    params: tuple = ()
    cap: int | None = None

    def _raw(self, rng: random.Random) -> float:
        k, p = self.kind, self.params
        if k == "constant":
            return p[0]
        if k == "uniform":
            return rng.randint(p[0], p[1])
        if k == "normal":
            return rng.gauss(p[0], p[1])
        if k == "lognormal":
            return math.exp(rng.gauss(math.log(p[0]), p[1]))
        if k == "choice":
            return rng.choice(p)
        if k == "histogram":
            lo, hi, _ = p[_pick(p, rng)]
            return rng.randint(lo, hi)
        raise AssertionError(k)

    def sample(self, rng: random.Random) -> int:
        n = max(1, int(round(self._raw(rng))))
        return min(n, self.cap) if self.cap else n

    def mean(self) -> float | None:
        """Expected value before clipping (None where it has no simple closed form)."""
        k, p = self.kind, self.params
        if k == "constant":
            return float(p[0])
        if k == "uniform":
            return (p[0] + p[1]) / 2
        if k == "normal":
            return float(p[0])
        if k == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        if k == "choice":
            return sum(p) / len(p)
        if k == "histogram":
            total = sum(w for _, _, w in p)
            return sum((lo + hi) / 2 * w for lo, hi, w in p) / total
        return None


def _cumulative(hist) -> list[float]:
    out, acc = [], 0.0
    for _, _, w in hist:
        acc += w
        out.append(acc)
    return out


def _pick(hist, rng: random.Random) -> int:
    cum = _cumulative(hist)
    return min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(hist) - 1)


def parse_length(spec: str, cap: int | None = None) -> LengthDist:
    """Parse a length spec (see the module doc); raises LengthSpecError naming the problem."""
    s = str(spec).strip()
    try:
        if s == "chat-prompt":
            return LengthDist(s, "histogram", CHAT_PROMPT_HISTOGRAM, cap)
        if s == "chat-output":
            return LengthDist(s, "histogram", CHAT_OUTPUT_HISTOGRAM, cap)
        if s.isdigit():
            if int(s) < 1:
                raise LengthSpecError(f"length {s!r} must be at least 1")
            return LengthDist(s, "constant", (int(s),), cap)
        kind, _, rest = s.partition(":")
        if kind == "uniform":
            lo, hi = (int(x) for x in rest.split(":"))
            if not 1 <= lo <= hi:
                raise LengthSpecError(f"{s!r}: need 1 <= low <= high")
            return LengthDist(s, kind, (lo, hi), cap)
        if kind in ("normal", "lognormal"):
            a, b = (float(x) for x in rest.split(":"))
            if a <= 0 or b < 0:
                raise LengthSpecError(f"{s!r}: need a positive centre and a non-negative spread")
            return LengthDist(s, kind, (a, b), cap)
        if kind == "choice":
            vals = tuple(int(x) for x in rest.split(",") if x.strip())
            if not vals or min(vals) < 1:
                raise LengthSpecError(f"{s!r}: need positive values")
            return LengthDist(s, kind, vals, cap)
    except (TypeError, ValueError) as e:
        if isinstance(e, LengthSpecError):
            raise
        raise LengthSpecError(f"cannot parse length spec {s!r}: {e}") from None
    raise LengthSpecError(
        f"unknown length spec {s!r}: use N, uniform:LO:HI, normal:MEAN:SD, lognormal:MEDIAN:SIGMA, "
        "choice:A,B,..., chat-prompt or chat-output")


def poisson_schedule(rate: float, n: int, rng: random.Random, duration_s: float | None = None) -> list[float]:
    """Arrival offsets (seconds from the start) of an open-loop Poisson process at `rate` requests/s.

    At most `n` arrivals, and none at or after `duration_s` when given. Gaps are exponential
    with mean 1/rate; the first arrival is at the first gap, not at 0.
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(rate)
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return out


# ---- prompts -----------------------------------------------------------------

_TOPICS = ("the garden", "a trip to the mountains", "learning to cook", "the history of trains",
           "writing a short story", "planning a budget", "a new programming language", "the ocean",
           "training for a marathon", "a museum visit", "fixing a bicycle", "the night sky")
_WORDS = ("the a of and to in is it that for you was with on as have be at one this from by not but what "
          "all were when we there can an your which their said if will each about how up out them then "
          "she many some so these would other into has more her two like him see time could no make than "
          "first been its who now people my made over did down only way find use may water long little very "
          "after words called just where most know get through back much before go good new write our used "
          "me man too any day same right look think also around another came come work three word must "
          "because does part even place well such here take why things help put years different away again "
          "off went old number great tell men say small every found still between name should home big give "
          "air line set own under read last never us left end along while might next sound below saw "
          "something thought both few those always looked show large often together asked house world going "
          "want school important until form food keep children feet land side without boy once animals life "
          "enough took sometimes four head above kind began almost live page got earth need far hand high "
          "year mother light parts country father let night following picture being study second eyes soon "
          "times story boys since white days ever paper hard near sentence better best across during today "
          "others however sure means knew its try told young miles sun ways thing whole hear example heard "
          "several change answer room sea against top turned learn point city play toward five using himself "
          "usually").split()


def chat_text(rng: random.Random, words: int) -> str:
    """Chat-like user text of about `words` words: a request about a topic, then filler sentences."""
    topic = rng.choice(_TOPICS)
    out = f"Hello! I have a question about {topic}.".split()
    while len(out) < words:
        n = rng.randint(6, 16)
        sent = [rng.choice(_WORDS) for _ in range(n)]
        sent[0] = sent[0].capitalize()
        out.extend(sent[:-1] + [sent[-1] + rng.choice((".", ".", "?", ","))])
    return " ".join(out[:words])


# English text runs about 1.3 tokens per word with common BPE vocabularies.
TOKENS_PER_WORD = 1.3


@dataclass
class PromptMaker:
    """Builds prompts of a target token count.

    With a tokenizer, a prompt is a window of tokens of a long generated chat text, decoded,
    and its length is counted with the tokenizer as the server counts it. Without one, the
    length is estimated from the word count.
    """

    tokenizer: object | None = None
    seed: int = 0
    _ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.tokenizer is not None:
            rng = random.Random(self.seed)
            text = " ".join(chat_text(rng, 400) for _ in range(40))
            self._ids = list(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, rng: random.Random, tokens: int) -> tuple[str, int, str]:
        """(prompt, its token count, how it was counted: 'tokenizer' or 'estimate')."""
        if self.tokenizer is None:
            words = max(1, round(tokens / TOKENS_PER_WORD))
            return chat_text(rng, words), tokens, "estimate"
        while len(self._ids) < tokens + 1:
            self._ids = self._ids + self._ids
        start = rng.randrange(0, len(self._ids) - tokens)
        text = self.tokenizer.decode(self._ids[start:start + tokens], skip_special_tokens=True).strip()
        return text, len(self.tokenizer(text).input_ids), "tokenizer"


# ---- conversations (--profile multiturn) --------------------------------------------------------

@dataclass
class Conversation:
    """A conversation behind a system prompt, each turn sending its whole history as chat clients do:
    the system prompt, every earlier user message and answer, then the new user message."""

    system: str
    user_messages: list[str]  # one per turn
    max_new_tokens: list[int]  # one per turn
    answers: list[str] = field(default_factory=list)  # as the server returned them, turn by turn

    @property
    def turns(self) -> int:
        return len(self.user_messages)

    def prompt(self, turn: int) -> str:
        """Turn `turn` (from 0) as one text: the previous turn's prompt, its answer, the new message."""
        out = self.system
        for i in range(turn + 1):
            out += f"\n\nUser: {self.user_messages[i]}\n\nAssistant:"
            if i < turn:
                out += self.answers[i]
        return out

    def messages(self, turn: int) -> list[dict]:
        """Turn `turn` (from 0) as chat messages."""
        out = [{"role": "system", "content": self.system}]
        for i in range(turn + 1):
            out.append({"role": "user", "content": self.user_messages[i]})
            if i < turn:
                out.append({"role": "assistant", "content": self.answers[i]})
        return out


@dataclass
class ConversationMaker:
    """Conversations of `turns` turns behind one shared system prompt of about `system_tokens` tokens;
    user messages follow `user_dist`, answers are asked for `output_dist` tokens."""

    maker: PromptMaker
    system_tokens: int
    user_dist: LengthDist
    output_dist: LengthDist
    turns: int
    seed: int = 0
    system: str = ""

    def __post_init__(self):
        if not self.system:
            self.system = self.maker.make(random.Random(self.seed * 7 + 1), self.system_tokens)[0]

    def conversation(self, index: int) -> Conversation:
        """The `index`-th conversation, the same on every run with the same seed."""
        rng = random.Random(self.seed * 1_000_003 + index)
        users = [self.maker.make(rng, self.user_dist.sample(rng))[0] for _ in range(self.turns)]
        return Conversation(self.system, users, [self.output_dist.sample(rng) for _ in range(self.turns)])
