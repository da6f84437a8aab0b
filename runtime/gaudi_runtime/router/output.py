"""From the shards' tokens to each request's stream events.

For each token the shards answer, the output processor decodes the text it adds (incrementally,
router/detokenizer.py; a special token is shown whole and kept out of the generated text), checks
whether the request ends with it and why (EOS, its max_new_tokens, a stop sequence anywhere in the
text so far) and puts the event on the request's queue. The last event carries the GenerationEnd
and is delivered through `Requests.end`, which gives the request's blocks back.

A token for a request that already ended is dropped: a call made before it ended still named it.
"""

from __future__ import annotations

import time

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.live_requests import Requests, RequestState
from gaudi_runtime.router.types import FinishReason, GenerationEnd, StreamEvent, Token


class OutputProcessor:
    def __init__(self, tokenizer, requests: Requests):
        self.tokenizer = tokenizer
        self.requests = requests
        self.special_ids = tokenizer.special_ids
        self.eos_ids: set[int] = set()  # the model's, from the shards' Info

    def process(self, gens: pb.Generations) -> list[int]:
        """Stream one step's tokens (after a prefill's prompt logprobs); returns the requests still running."""
        for p in gens.prefill:
            state = self.requests.get(p.request_id)
            if state is not None:
                state.prefill = [self._token(t, lp) for t, lp in zip(state.req.input_ids, p.logprobs)]
        running = []
        top_n = gens.top_n
        for i, rid in enumerate(gens.request_ids):
            state = self.requests.get(rid)
            if state is None:  # ended; a call made before it ended still named it
                continue
            top = zip(gens.top_ids[i * top_n:(i + 1) * top_n],
                      gens.top_logprobs[i * top_n:(i + 1) * top_n]) if top_n else ()
            self._on_token(state, gens.token_ids[i], gens.logprobs[i], top)
            if not state.ended:
                running.append(rid)
        return running

    def _on_token(self, state: RequestState, token_id: int, logprob: float, top) -> None:
        state.generated += 1
        state.output_ids.append(token_id)
        special = token_id in self.special_ids
        text = self.tokenizer.decode([token_id], skip_special_tokens=False) if special else state.detok.add(token_id)
        finish = self._finish_reason(state, token_id)
        if finish is not None and not special:
            text += state.detok.flush()
        event = StreamEvent(Token(token_id, text, logprob, special), [self._token(t, lp) for t, lp in top])
        if finish is None:
            state.events.put_nowait(event)
            return
        event.end = self._generation_end(state, finish)
        self.requests.end(state, event)

    def _finish_reason(self, state: RequestState, token_id: int) -> FinishReason | None:
        """Why the request ends with this token, or None; EOS first, then the budget, then stop sequences."""
        stopping = state.req.stopping
        if token_id in self.eos_ids and not stopping.ignore_eos_token:
            return FinishReason.EOS_TOKEN
        if state.generated >= stopping.max_new_tokens:
            return FinishReason.LENGTH
        if stopping.stop_sequences and state.stop.check(state.detok.text):
            return FinishReason.STOP_SEQUENCE
        return None

    def _generation_end(self, state: RequestState, finish: FinishReason) -> GenerationEnd:
        sampling = state.req.sampling
        return GenerationEnd(
            finish_reason=finish, generated_text=state.detok.text, generated_tokens=state.generated,
            seed=sampling.seed if sampling.do_sample else None, prefill=state.prefill,
            queue_time=state.started - state.enqueued, inference_time=time.monotonic() - state.started,
        )

    def _token(self, token_id: int, logprob: float) -> Token:
        """A prompt or top token: its own text, special tokens included."""
        return Token(token_id, self.tokenizer.decode([token_id], skip_special_tokens=False), logprob,
                     token_id in self.special_ids)
