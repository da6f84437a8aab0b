"""Sampling around a forward pass: the sampler of a new batch, the step's tokens, the prompt's log-probabilities.

The sampler itself (`sampling.py`) and the grammar matchers (`grammar.py`) know nothing of the device's
step; this is where they meet it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.shard.grammar import GrammarCache, GrammarRows, ThinkingGate
from gaudi_runtime.shard.inputs import PrefillInput
from gaudi_runtime.shard.sampling import BatchSampler, SampleOutput


def grammar_rows(grammars: GrammarCache | None, reqs: list[PrefillInput]) -> GrammarRows | None:
    """A matcher per constrained request, from the grammar the router had compiled under the id the
    request names. `grammars` is None where grammars are turned off."""
    if grammars is None or all(r.grammar is None for r in reqs):
        if any(r.grammar is not None for r in reqs):
            raise ValueError("grammar is not supported")
        return None
    try:
        return GrammarRows.of(grammars, [None if r.grammar is None else _matcher(grammars, r) for r in reqs])
    except ValueError as e:
        raise ValueError(f"grammar: {e}") from e


def _matcher(grammars: GrammarCache, r: PrefillInput):
    """The request's matcher; a reasoning model's behind a gate that holds it until the thinking ends."""
    m = grammars.matcher(r.grammar)
    return m if r.thinking is None else ThinkingGate(m, *r.thinking)


def prefill_sampler(reqs: list[PrefillInput], vocab_size: int, device: torch.device,
                    grammars: GrammarCache | None) -> BatchSampler:
    """The sampler a new batch keeps for all its steps, one row per request."""
    return BatchSampler([r.params for r in reqs], [r.top_n_tokens for r in reqs], [r.input_ids for r in reqs],
                        vocab_size, device, grammar_rows(grammars, reqs))


def sample(backend: Backend, sampler: BatchSampler, logits: torch.Tensor, rows: int) -> SampleOutput:
    """Sample the step whose forward pass was just queued. With grammars, the matchers fill the
    bitmask on the host meanwhile (the device is still computing `logits` on HPU and CUDA), and
    then take the sampled tokens, which costs every rank a read-back of the step's tokens."""
    out = sampler(logits, _grammar_mask(backend, sampler, rows))
    backend.mark_step()
    if sampler.grammar is not None:
        sampler.accept(out.next_ids[:len(sampler)].tolist())
    return out


def verify(backend: Backend, sampler: BatchSampler, logits: torch.Tensor,
           tokens: np.ndarray) -> tuple[SampleOutput, list[list[int]]]:
    """Sample a speculative step: `logits` [width, >= B, V] were computed over `tokens` [B, width] (each
    row's fed token, then its drafts, -1 past them). Position j is sampled as plain decoding would sample
    it, for the rows whose drafts before j were all accepted; a row goes on while its sampled token equals
    its next draft. With a one-token (n-gram) draft this is speculative sampling: the draft is kept with
    the probability the model gives it, and a rejected position's token is drawn from the rest.

    Returns the emitted tokens flattened row by row (a row's in order), and each row's tokens. `logits`
    may stop before `tokens` do where no row has a token past them (a pass cut to the longest draft)."""
    b, width = tokens.shape[0], min(tokens.shape[1], logits.shape[0])
    active = np.ones(b, dtype=bool)
    outs, emitting = [], []
    for j in range(width):
        mask = None if active.all() else torch.from_numpy(active).to(logits.device)
        out = sampler(logits[j], None if j else _grammar_mask(backend, sampler, logits.shape[1]), mask)
        backend.mark_step()
        ids = out.next_ids[:b].cpu().numpy()
        if j == 0 and sampler.grammar is not None:
            sampler.accept(ids.tolist())  # rows with a grammar draft nothing: position 0 is their step
        outs.append(out)
        emitting.append(active.copy())
        if j + 1 == width:
            break
        active &= ids == tokens[:, j + 1]
        if not active.any():
            break
    return _flatten(outs, np.stack(emitting, axis=1))


def _grammar_mask(backend: Backend, sampler: BatchSampler, rows: int) -> torch.Tensor | None:
    """The rows' allowed tokens on the device (`rows` >= the batch: a bucket's), None without a grammar."""
    return None if sampler.grammar is None else backend.upload(sampler.grammar.fill(rows))


def _flatten(outs: list[SampleOutput], emitted: np.ndarray) -> tuple[SampleOutput, list[list[int]]]:
    """The tokens of `outs` (one per position) that `emitted` [B, positions] marks, row by row."""
    rows, cols = np.nonzero(emitted)  # row-major: each row's positions in order
    device = outs[0].next_ids.device
    r, c = torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)
    def pick(parts):
        return None if parts[0] is None else torch.stack([p[:emitted.shape[0]] for p in parts], 1)[r, c]
    out = SampleOutput(next_ids=pick([o.next_ids for o in outs]), logprobs=pick([o.logprobs for o in outs]),
                       top_ids=pick([o.top_ids for o in outs]), top_logprobs=pick([o.top_logprobs for o in outs]))
    ids = out.next_ids.tolist()
    counts = emitted.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return out, [ids[s:s + n] for s, n in zip(starts, counts)]


def prompt_logprobs(compute_logits, hidden: torch.Tensor, ids: np.ndarray,
                    reqs: list[PrefillInput]) -> dict[int, list[float]]:
    """The log-probability of each prompt token after the ones before it, for the requests that want
    them (NaN for the first), by request id. Such rows computed their whole prompt (no cached tokens),
    so `hidden` [rows, seq] and the padded `ids` hold all of it."""
    result = {}
    for i, r in enumerate(reqs):
        if not r.prefill_logprobs:
            continue
        n = len(r.input_ids)
        lp = torch.log_softmax(compute_logits(hidden[i, : n - 1]), dim=-1)
        nxt = torch.from_numpy(ids[i, 1:n]).to(lp.device)
        result[r.id] = [math.nan] + lp.gather(1, nxt[:, None]).squeeze(1).tolist()
    return result
