"""A deterministic Engine for HTTP tests, and a helper running the app in a thread.

The fake "generates" the prompt's own tokens again (in a cycle), then EOS, honouring
max_new_tokens, stop sequences (with the real detokenizer and matcher) and
ignore_eos_token. Markers in the prompt text steer it, so tests need no shared state:

    FAIL:overloaded     raise OverloadedError before the first token
    FAIL:generation     raise GenerationError before the first token
    FAIL:after=N        raise GenerationError after N tokens
    ENDLESS             ignore EOS (generate until max_new_tokens)
    SLOW                pace tokens 10 ms apart (a request that lasts)
    HANG:N              after N tokens, wait until closed (a request that never ends)
    BURST:N             hand tokens to the stream N at a time (default BURST), as a decode call of
                        several steps does; SLOW hands them one at a time
    REPLY<<text>>END    generate the tokens of `text` (then EOS) instead of the prompt's: an output
                        of the test's choosing, such as a tool call in the model's format
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from gaudi_runtime.router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from gaudi_runtime.router.server import start
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import (
    FinishReason,
    GenerationEnd,
    GenerationError,
    OverloadedError,
    StreamEvent,
    Token,
    ValidRequest,
)

BURST = 3  # tokens handed over together, unless the prompt says otherwise


@dataclass
class FakeEngine:
    tokenizer: RouterTokenizer
    healthy: bool = True
    health_body: dict = field(default_factory=lambda: {"status": "ready"})
    started: list[ValidRequest] = field(default_factory=list)
    finished: list[ValidRequest] = field(default_factory=list)
    closed: list[ValidRequest] = field(default_factory=list)  # closed by the caller before the end
    active: int = 0

    def health(self) -> tuple[bool, dict]:
        return self.healthy, dict(self.health_body)

    def info(self) -> dict:
        return {"engine": "fake", "kv_blocks": 0}

    async def check_grammars(self, requests: list[ValidRequest]) -> None:
        pass  # no shards to compile on: every grammar is taken

    def queue_size(self) -> int:
        return 0

    def _token(self, tid: int, text: str, logprob: float) -> Token:
        return Token(tid, text, logprob, tid in self.tokenizer.special_ids)

    async def generate_groups(self, request: ValidRequest):
        text = request.inputs
        self.started.append(request)
        if "FAIL:overloaded" in text:
            raise OverloadedError("Model is overloaded")
        if "FAIL:generation" in text:
            raise GenerationError("Request failed during generation: fake shard failure")
        m = re.search(r"FAIL:after=(\d+)", text)
        fail_after = int(m.group(1)) if m else None
        m = re.search(r"HANG:(\d+)", text)
        hang_after = int(m.group(1)) if m else None
        m = re.search(r"BURST:(\d+)", text)
        burst = 1 if "SLOW" in text else int(m.group(1)) if m else BURST
        events = self._events(request)
        batch: list[StreamEvent] = []
        done = False
        self.active += 1
        try:
            for i in range(request.stopping.max_new_tokens):
                if (i == hang_after or i == fail_after) and batch:  # what came before is streamed first
                    yield batch
                    batch = []
                if hang_after is not None and i >= hang_after:
                    await asyncio.Event().wait()  # until the caller closes us (cancelled)
                if fail_after is not None and i >= fail_after:
                    raise GenerationError("Request failed during generation: fake failure mid-stream")
                batch.append(next(events))
                done = batch[-1].end is not None
                if done:
                    self.finished.append(request)
                if done or len(batch) == burst:
                    yield batch
                    batch = []
                    if done:
                        return
                    await asyncio.sleep(0.01 if "SLOW" in text else 0)
        finally:
            self.active -= 1
            if not done:
                self.closed.append(request)

    def _events(self, request: ValidRequest):
        """The request's events, one per token, the last with its end."""
        tok = self.tokenizer
        reply = re.search(r"REPLY<<(.*?)>>END", request.inputs, re.DOTALL)
        source = tok.encode(reply.group(1), add_special_tokens=False) if reply else \
            [t for t in request.input_ids if t not in tok.special_ids] or list(request.input_ids)
        eos = tok.eos_token_id
        endless = "ENDLESS" in request.inputs or request.stopping.ignore_eos_token
        detok = IncrementalDetokenizer(tok, prompt_ids=request.input_ids)
        stop = StopSequenceMatcher(request.stopping.stop_sequences)
        s = request.sampling
        # Sampled runs differ by seed (so best_of has something to choose from).
        logprob = -((s.seed % 7) + 1) / 10 if s.do_sample else -0.25
        prefill = []
        if request.decoder_input_details:
            prefill = [Token(t, tok.decode([t]), float("nan") if i == 0 else -1.0, t in tok.special_ids)
                       for i, t in enumerate(request.input_ids)]
        t0 = time.monotonic()
        for i in range(request.stopping.max_new_tokens):
            tid = source[i % len(source)] if i < len(source) or endless or eos is None else eos
            piece = detok.add(tid)
            finish = None
            if tid == eos and not endless:
                finish = FinishReason.EOS_TOKEN
            elif stop.check(detok.text):
                finish = FinishReason.STOP_SEQUENCE
            elif i + 1 == request.stopping.max_new_tokens:
                finish = FinishReason.LENGTH
            end = None
            if finish is not None:
                piece += detok.flush()
                end = GenerationEnd(
                    finish_reason=finish, generated_text=tok.decode(detok.token_ids, skip_special_tokens=True),
                    generated_tokens=i + 1,
                    seed=s.seed if s.do_sample else None, prefill=prefill,
                    queue_time=0.001, inference_time=time.monotonic() - t0)
            tops = [self._token(t, tok.decode([t]), logprob - 0.1 * k)
                    for k, t in enumerate(source[: request.top_n_tokens])]
            yield StreamEvent(self._token(tid, piece, logprob), tops, end)
            if end is not None:
                return


class ServerThread:
    """Serve an aiohttp app on 127.0.0.1 (free port) from its own thread and event loop,
    so that both blocking clients and asyncio tests can talk to it."""

    def __init__(self, app: web.Application):
        self.app = app
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http-test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner, self.port = loop.run_until_complete(start(self.app, "127.0.0.1", 0))
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("test server did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def async_wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """`wait_for` for asyncio tests: poll without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
