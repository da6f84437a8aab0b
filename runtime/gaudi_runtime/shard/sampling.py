"""Batched next-token selection for the shard, with TGI's parameters.

Everything in ``BatchSampler.__call__`` is tensor code over the whole batch: no Python loop over rows
and no host-device synchronisation (the caller does ``.tolist()`` on the outputs). Which processors
run is decided on the host, once, when the sampler is built (or filtered/concatenated), so a batch
that only asks for greedy decoding pays for an argmax and a log-softmax and nothing else (on a CPU,
without top-n tokens, one C call that gives both: ``device/cpu_sampling.py``).

Semantics (TGI's ``HeterogeneousNextTokenChooser``):

* Order: repetition penalty, TGI's frequency penalty, OpenAI's frequency and presence penalties, then
  temperature, top-k, top-p, typical-p.
* A row samples when ``do_sample`` is set *or* any warper is active (temperature != 1, top_k != 0,
  top_p < 1, typical_p < 1), exactly like TGI. Otherwise it takes the argmax of the penalised logits.
  A temperature <= 0 (which the router rejects anyway) is treated as greedy instead of dividing by 0.
* Repetition penalty (CTRL): for every token seen in prompt + generated tokens, a negative logit is
  multiplied by the penalty and a non-negative one divided by it.
* ``frequency_penalty`` is TGI's (``HeterogeneousFrequencyPenaltyLogitsProcessor``), what TGI's
  ``/generate`` clients expect: subtract ``penalty * count(token) / length`` where ``count`` is the
  token's number of occurrences among the row's prompt + generated tokens and ``length`` that row's
  total number of tokens. (TGI divides by the padded batch length and counts padding as token 0; we use
  the row's own length so that the result does not depend on batch composition.)
* ``generated_frequency_penalty`` and ``presence_penalty`` are OpenAI's (what the OpenAI routes send):
  subtract ``frequency * n + presence * (n > 0)`` where ``n`` is how many times the row has generated
  the token so far; prompt tokens do not count.
* Log-probabilities (chosen token and top-n) are ``log_softmax`` of the penalised logits divided by the
  temperature, before top-k/top-p/typical-p truncation.
* A row with a grammar (``shard/grammar.py``) has the tokens its grammar forbids set to -inf first, from
  a bitmask the caller fills on the host and passes to the call; its log-probabilities are therefore
  those of the constrained distribution. The matchers ride along with the rows through
  ``filter``/``concat``.

Reproducible sampling without per-row ``torch.Generator``: the Gumbel-max trick, with the noise for
vocabulary index ``i`` of a row computed by a counter-based hash (splitmix64) of ``(seed, step, i)``
in int64 tensor arithmetic (torch wraps on overflow, which is what the hash needs). ``step`` is the
number of tokens the request has generated so far, tracked per row and carried through
``filter``/``concat``. The token chosen for a row therefore depends only on its logits, its parameters,
its seed and its step: not on its position in the batch, the batch's other rows, or the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gaudi_runtime.device import cpu_sampling
from gaudi_runtime.params import SamplingParameters, samples
from gaudi_runtime.shard.grammar import GrammarRows, allowed_tokens

__all__ = ["BatchSampler", "SampleOutput", "gumbel_noise", "splitmix64"]

_U64 = (1 << 64) - 1


ARGMAX_CHUNK = 64


def cpu_greedy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, log-probabilities) of greedy rows from the CPU's C kernel, which reads the scores twice where
    a log_softmax and an argmax read them several times; None on another device, without the kernel, or
    for rows it leaves to torch (a NaN, no finite maximum)."""
    if not scores.is_cpu:  # the kernel reads host memory; elsewhere it is not even built
        return None
    kernel = cpu_sampling.kernel()
    return None if kernel is None else kernel(scores)


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``argmax(scores, dim=-1)`` of a ``[B, V]`` float tensor, the first index on ties, as torch's.

    Torch's CPU argmax reduces one element at a time while ``amax`` is vectorized, so over a large
    vocabulary it is far cheaper to take each chunk's maximum, the first chunk holding the row's
    maximum, and then the argmax within that one chunk.
    """
    b, v = scores.shape
    chunks = -(-v // ARGMAX_CHUNK)
    if chunks * ARGMAX_CHUNK != v:
        scores = torch.nn.functional.pad(scores, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    blocks = scores.reshape(b, chunks, ARGMAX_CHUNK)
    best = blocks.amax(-1).argmax(-1)  # [B]
    within = blocks.gather(1, best.view(b, 1, 1).expand(b, 1, ARGMAX_CHUNK)).view(b, ARGMAX_CHUNK).argmax(-1)
    return best * ARGMAX_CHUNK + within


def _s64(x: int) -> int:
    """A Python int taken modulo 2**64, as the int64 with the same bits."""
    x &= _U64
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical (unsigned) right shift of an int64 tensor by ``k`` bits (1 <= k <= 63)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (bitwise equal to the uint64 version)."""
    x = (x ^ _lsr(x, 30)) * _MIX1
    x = (x ^ _lsr(x, 27)) * _MIX2
    return x ^ _lsr(x, 31)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per row from (seed, step), both int64 [B]."""
    return splitmix64(splitmix64(seeds + _GAMMA) + steps * _GAMMA)


_INV_2_23 = 1.0 / (1 << 23)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_offsets: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32, a pure function of (seed, step, vocabulary index).

    ``vocab_offsets`` is ``(arange(V) + 1) * GAMMA`` as int64 (see ``_vocab_offsets``). The top 23 bits
    of the hash give ``v = (k + 0.5) / 2**23`` in (0, 1), exactly representable in float32; with
    ``u = 1 - v`` the noise is ``-log(-log(u)) = -log(-log1p(-v))``, which keeps full precision in the
    upper tail (u close to 1) where the Gumbel-max trick needs it.
    """
    z = splitmix64(_row_keys(seeds, steps).unsqueeze(1) + vocab_offsets.unsqueeze(0))
    v = (_lsr(z, 41).to(torch.float32) + 0.5) * _INV_2_23
    return -torch.log(-torch.log1p(-v))


def _vocab_offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device)) * _GAMMA


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log-probability of the chosen token
    # [B, n] int64 / float32, best first, n = max top_n_tokens in the batch (None if all 0). Every row
    # gets n entries: the caller keeps the first top_n_tokens[i] of row i.
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _uses_penalty(p: SamplingParameters) -> bool:
    """The row's penalties read the counts over prompt + generated tokens."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0


def _uses_generated_penalty(p: SamplingParameters) -> bool:
    """The row's penalties read the counts over generated tokens only (OpenAI's)."""
    return p.generated_frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _column_unless(values: list, neutral, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A [B, 1] column of ``values``, or None when every row has the neutral value (nothing to apply)."""
    return _column(values, dtype, device) if any(v != neutral for v in values) else None


def _cat_counts(samplers: Sequence[BatchSampler], attr: str) -> torch.Tensor | None:
    """The ``attr`` count tensors of ``samplers`` stacked, or None when none has them. Rows of a
    sampler without them get zeros: they use no penalty that reads them."""
    if all(getattr(s, attr) is None for s in samplers):
        return None
    first = samplers[0]
    parts = []
    for s in samplers:
        counts = getattr(s, attr)
        if counts is None:
            counts = torch.zeros((len(s), first.vocab_size), dtype=torch.float32, device=first.device)
        parts.append(counts)
    return torch.cat(parts)


@dataclass
class _RowState:
    """What a row carries from one call to the next (through ``filter`` and ``concat`` too)."""

    steps: torch.Tensor  # [B] int64: tokens generated so far (the noise's counter)
    lengths: torch.Tensor  # [B] int64: prompt + generated tokens
    counts: torch.Tensor | None  # [B, V] float32 over prompt + generated, when a row uses such a penalty
    generated_counts: torch.Tensor | None  # [B, V] float32 over generated tokens, likewise
    grammar: GrammarRows | None = None  # the rows' grammar matchers, when some row has a grammar


class BatchSampler:
    """Next-token selection for one batch of requests (rows in batch order).

    State carried between calls, per row: the number of tokens generated so far (``steps``), the
    row's total token count (``lengths``: prompt + generated) and, only when some row uses a penalty
    that reads them, the token counts ``counts`` [B, V] over prompt + generated tokens and
    ``generated_counts`` [B, V] over generated tokens.
    """

    def __init__(
        self,
        params: Sequence[SamplingParameters],
        top_n_tokens: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        grammar: GrammarRows | None = None,
    ) -> None:
        if not (len(params) == len(top_n_tokens) == len(prompt_ids)):
            raise ValueError(
                f"params ({len(params)}), top_n_tokens ({len(top_n_tokens)}) and prompt_ids "
                f"({len(prompt_ids)}) must have the same length"
            )
        device = torch.device(device)
        b = len(params)
        counts = generated = None
        if any(_uses_penalty(p) for p in params):
            counts = self._prompt_counts(params, prompt_ids, vocab_size, device)
        if any(_uses_generated_penalty(p) for p in params):
            generated = torch.zeros((b, vocab_size), dtype=torch.float32, device=device)
        state = _RowState(
            steps=torch.zeros(b, dtype=torch.int64, device=device),
            lengths=torch.tensor([len(ids) for ids in prompt_ids], dtype=torch.int64, device=device),
            counts=counts,
            generated_counts=generated,
            grammar=grammar,
        )
        self._setup(list(params), list(top_n_tokens), vocab_size, device, state)

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _prompt_counts(
        params: Sequence[SamplingParameters],
        prompt_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Token counts [B, V] float32 of each penalised row's prompt (zeros for other rows)."""
        b = len(params)
        rows = [
            [int(t) for t in ids] if _uses_penalty(p) else []
            for p, ids in zip(params, prompt_ids, strict=True)
        ]
        if any(t < 0 or t >= vocab_size for r in rows for t in r):
            raise ValueError(f"prompt token id out of range [0, {vocab_size})")
        width = max((len(r) for r in rows), default=0)
        # Pad with index ``vocab_size`` (an extra column dropped afterwards).
        padded = torch.full((b, max(width, 1)), vocab_size, dtype=torch.int64)
        for i, r in enumerate(rows):
            if r:
                padded[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        counts = torch.zeros((b, vocab_size + 1), dtype=torch.float32)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
        return counts[:, :vocab_size].contiguous().to(device)

    def _setup(
        self,
        params: list[SamplingParameters],
        top_n_tokens: list[int],
        vocab_size: int,
        device: torch.device,
        state: _RowState,
    ) -> None:
        """Decide on the host, once, which processors run, and build their [B, 1] parameter columns."""
        self.params = params
        self.top_n_tokens = [int(n) for n in top_n_tokens]
        self.vocab_size = int(vocab_size)
        self.device = device
        self.steps = state.steps
        self.lengths = state.lengths
        self.grammar = state.grammar
        self.counts = state.counts if any(_uses_penalty(p) for p in params) else None
        self.generated_counts = (
            state.generated_counts if any(_uses_generated_penalty(p) for p in params) else None
        )
        sample = [samples(p) for p in params]
        self.do_sample = sample
        self.any_sample = any(sample)
        self.all_sample = len(params) > 0 and all(sample)
        self.max_top_n = max(self.top_n_tokens, default=0)
        self._setup_penalties(params)
        self._setup_warpers(params, sample)
        if self.any_sample:
            self.sample_mask = torch.tensor(sample, dtype=torch.bool, device=device)
            self.seeds = torch.tensor([_s64(int(p.seed)) for p in params], dtype=torch.int64, device=device)
            self._offsets = _vocab_offsets(self.vocab_size, device)
        else:
            self.sample_mask = self.seeds = self._offsets = None

    def _setup_penalties(self, params: list[SamplingParameters]) -> None:
        """Penalties apply to greedy and sampled rows alike."""
        f32, device = torch.float32, self.device
        self.rep_penalty = _column_unless([p.repetition_penalty for p in params], 1.0, f32, device)
        self.freq_penalty = _column_unless([p.frequency_penalty for p in params], 0.0, f32, device)
        self.generated_freq_penalty = _column_unless(
            [p.generated_frequency_penalty for p in params], 0.0, f32, device)
        self.presence_penalty = _column_unless([p.presence_penalty for p in params], 0.0, f32, device)

    def _setup_warpers(self, params: list[SamplingParameters], sample: list[bool]) -> None:
        """Only sampled rows carry non-neutral warper values."""
        device, vocab_size = self.device, self.vocab_size
        rows = list(zip(params, sample, strict=True))
        temp = [p.temperature if s else 1.0 for p, s in rows]
        top_k = [min(p.top_k, vocab_size) if s and p.top_k > 0 else 0 for p, s in rows]
        top_p = [p.top_p if s and p.top_p < 1.0 else 1.0 for p, s in rows]
        typ = [p.typical_p if s and p.typical_p < 1.0 else 1.0 for p, s in rows]
        self.temperature = _column_unless(temp, 1.0, torch.float32, device)
        if any(k > 0 for k in top_k):
            self.max_top_k = max(top_k)
            self.top_k_index = _column([max(k - 1, 0) for k in top_k], torch.int64, device)
            self.top_k_off = _column([k == 0 for k in top_k], torch.bool, device)
        else:
            self.max_top_k = 0
            self.top_k_index = self.top_k_off = None
        if any(x < 1.0 for x in top_p):
            self.top_p = _column(top_p, torch.float32, device)
            self.top_p_off = _column([x >= 1.0 for x in top_p], torch.bool, device)
        else:
            self.top_p = self.top_p_off = None
        if any(x < 1.0 for x in typ):
            self.typical_p = _column(typ, torch.float32, device)
            self.typical_off = _column([x >= 1.0 for x in typ], torch.bool, device)
        else:
            self.typical_p = self.typical_off = None

    @classmethod
    def _from_state(
        cls,
        params: list[SamplingParameters],
        top_n_tokens: list[int],
        vocab_size: int,
        device: torch.device,
        state: _RowState,
    ) -> BatchSampler:
        self = cls.__new__(cls)
        self._setup(params, top_n_tokens, vocab_size, device, state)
        return self

    def __len__(self) -> int:
        return len(self.params)

    # ------------------------------------------------------------------ batch management

    def filter(self, keep: Sequence[int]) -> BatchSampler:
        """A sampler for the rows ``keep`` of this one, in that order, with their state."""
        keep = [int(i) for i in keep]
        if any(i < 0 or i >= len(self.params) for i in keep):
            raise IndexError(f"filter index out of range for a batch of {len(self.params)}")
        idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
        params = [self.params[i] for i in keep]
        counts = generated = None
        if self.counts is not None and any(_uses_penalty(p) for p in params):
            counts = self.counts.index_select(0, idx)
        if self.generated_counts is not None and any(_uses_generated_penalty(p) for p in params):
            generated = self.generated_counts.index_select(0, idx)
        grammar = self.grammar.filter(keep) if self.grammar is not None else None
        state = _RowState(self.steps.index_select(0, idx), self.lengths.index_select(0, idx), counts, generated,
                          grammar)
        return BatchSampler._from_state(
            params, [self.top_n_tokens[i] for i in keep], self.vocab_size, self.device, state)

    @staticmethod
    def concat(samplers: Sequence[BatchSampler]) -> BatchSampler:
        """One sampler whose rows are those of ``samplers``, in order, with their state."""
        if not samplers:
            raise ValueError("concat needs at least one sampler")
        first = samplers[0]
        if any(s.vocab_size != first.vocab_size for s in samplers):
            raise ValueError("cannot concatenate samplers with different vocabulary sizes")
        state = _RowState(
            steps=torch.cat([s.steps for s in samplers]),
            lengths=torch.cat([s.lengths for s in samplers]),
            counts=_cat_counts(samplers, "counts"),
            generated_counts=_cat_counts(samplers, "generated_counts"),
            grammar=GrammarRows.concat([(s.grammar, len(s)) for s in samplers]),
        )
        return BatchSampler._from_state(
            [p for s in samplers for p in s.params],
            [n for s in samplers for n in s.top_n_tokens],
            first.vocab_size,
            first.device,
            state,
        )

    # ------------------------------------------------------------------ the hot path

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor | None = None,
                 active: torch.Tensor | None = None) -> SampleOutput:
        """Choose the next token of every row from ``logits`` [>= B, V] (rows past B are ignored).

        ``bitmask`` [>= B, ceil(V / 32)] int32, on the logits' device: the tokens each row may take
        (``GrammarRows.fill``), or None when no row has a grammar. Records the chosen tokens (step
        counters, lengths, penalty counts) for the next call, only for the ``active`` rows [B] bool when
        given (a speculative step's later positions: the other rows' tokens there are thrown away); the
        grammar matchers advance in ``accept``, once the tokens are on the host.
        """
        b = len(self.params)
        if logits.dim() != 2 or logits.shape[0] < b or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for a batch of {b} rows and vocabulary {self.vocab_size}"
            )
        scores = logits[:b]
        if scores.dtype != torch.float32:
            scores = scores.float()
        if bitmask is not None:
            scores = scores.masked_fill(~allowed_tokens(bitmask[:b], self.vocab_size), float("-inf"))
        scores = self._penalise(scores)

        chosen = cpu_greedy(scores) if not self.any_sample and self.max_top_n == 0 else None
        if chosen is not None:
            next_ids, logprobs = chosen
        else:
            next_ids, logprobs_all = self._choose(scores)
            logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        top_ids = top_logprobs = None
        if self.max_top_n > 0:
            top_logprobs, top_ids = torch.topk(logprobs_all, min(self.max_top_n, self.vocab_size), dim=-1)

        self._record(next_ids, active)
        return SampleOutput(next_ids=next_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next ids, every token's log-probability) of the penalised scores, with torch."""
        if not self.any_sample:
            return row_argmax(scores), torch.log_softmax(scores, dim=-1)
        if self.temperature is not None:
            scores = scores / self.temperature
        logprobs_all = torch.log_softmax(scores, dim=-1)
        warped = self._warp(scores, logprobs_all)
        noise = gumbel_noise(self.seeds, self.steps, self._offsets)
        sampled = row_argmax(warped + noise)
        if self.all_sample:
            return sampled, logprobs_all
        return torch.where(self.sample_mask, sampled, row_argmax(scores)), logprobs_all

    def _penalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Repetition, TGI's frequency, OpenAI's frequency and presence penalties (greedy and sampled rows)."""
        if self.counts is not None:
            if self.rep_penalty is not None:
                penalised = torch.where(scores < 0, scores * self.rep_penalty, scores / self.rep_penalty)
                scores = torch.where(self.counts > 0, penalised, scores)
            if self.freq_penalty is not None:
                length = self.lengths.clamp_min(1).to(torch.float32).unsqueeze(1)
                scores = scores - self.freq_penalty * (self.counts / length)
        if self.generated_counts is not None:
            if self.generated_freq_penalty is not None:
                scores = scores - self.generated_freq_penalty * self.generated_counts
            if self.presence_penalty is not None:
                scores = scores - self.presence_penalty * (self.generated_counts > 0).to(torch.float32)
        return scores

    def accept(self, next_ids: Sequence[int]) -> None:
        """The tokens the rows took (on the host), for the rows' grammar matchers."""
        if self.grammar is not None:
            self.grammar.accept(next_ids)

    def _warp(self, scores: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Top-k, top-p, typical-p truncation (TGI's semantics) on temperature-scaled scores."""
        neg_inf = float("-inf")
        if self.top_k_index is not None:
            kth = torch.topk(scores, self.max_top_k, dim=-1).values.gather(1, self.top_k_index)
            kth = kth.masked_fill(self.top_k_off, neg_inf)
            scores = scores.masked_fill(scores < kth, neg_inf)
            if self.top_p is not None or self.typical_p is not None:
                logprobs = torch.log_softmax(scores, dim=-1)
        if self.top_p is not None:
            # Keep the smallest prefix of the tokens sorted by probability whose mass reaches top_p:
            # a token is kept when the mass strictly before it is < top_p (the first one always is).
            sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
            probs = sorted_lp.exp()
            before = torch.cumsum(probs, dim=-1) - probs
            remove_sorted = before >= self.top_p
            remove_sorted[:, 0] = False
            remove_sorted = remove_sorted & ~self.top_p_off
            remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
            scores = scores.masked_fill(remove, neg_inf)
            if self.typical_p is not None:
                logprobs = torch.log_softmax(scores, dim=-1)
        if self.typical_p is not None:
            # Typical decoding: sort by |-log p - H|, keep the shortest such prefix whose mass reaches
            # typical_p (ties with the last kept token are kept too).
            p = logprobs.exp()
            entropy = -(logprobs * p).nansum(dim=-1, keepdim=True)
            shifted = (-logprobs - entropy).abs()
            sorted_shifted, order = torch.sort(shifted, dim=-1)
            cum = torch.cumsum(p.gather(1, order), dim=-1)
            last = (cum < self.typical_p).sum(dim=-1, keepdim=True).clamp_max(self.vocab_size - 1)
            last = last.masked_fill(self.typical_off, self.vocab_size - 1)
            remove_sorted = sorted_shifted > sorted_shifted.gather(1, last)
            remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
            scores = scores.masked_fill(remove, neg_inf)
        return scores

    def _record(self, next_ids: torch.Tensor, active: torch.Tensor | None = None) -> None:
        taken = 1 if active is None else active.to(torch.int64)
        self.steps = self.steps + taken
        self.lengths = self.lengths + taken
        for counts in (self.counts, self.generated_counts):
            if counts is not None:
                ones = torch.ones((next_ids.shape[0], 1), dtype=torch.float32, device=self.device)
                if active is not None:
                    ones = ones * active.unsqueeze(1)
                counts.scatter_add_(1, next_ids.unsqueeze(1), ones)
