"""The router's per-token cost on the HTTP side, without shards: the stream writes and the detokenizer.

    python -m gaudi_runtime.bench.stream_path [--model-id DIR] [--users 48] [--requests 192]
        [--tokens 128] [--per-call 1 4] [--api tgi openai]

The router's real HTTP application (validation, handlers, SSE) serves `--users` concurrent streams
on loopback from a stand-in engine that hands every running request `--per-call` tokens at once,
call after call, as the batching loop does with a decode call's answer; a client in a child process
reads every stream to its end. Printed: the router process's CPU time (user + system) per streamed
token. Then the incremental detokenizer alone: CPU time per token over random vocabulary ids (what
the random-weight overhead model generates). The stand-in engine serves both the engine interface
of one event at a time (`generate`) and the one of the events ready together (`generate_groups`),
so this file can be run against an older checkout (`PYTHONPATH=OLD/runtime python
runtime/gaudi_runtime/bench/stream_path.py`) for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "gaudi-serve-bench" / "model-overhead"


class TickEngine:
    """Every `tick`, each running request gets `per_call` tokens on its queue at once."""

    def __init__(self, tokenizer, per_call: int):
        from gaudi_runtime.router.types import StreamEvent, Token

        self.per_call = per_call
        rng = random.Random(0)
        ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(256)]
        self.events = [StreamEvent(Token(i, tokenizer.decode([i]), -0.25 - k / 1000, False))
                       for k, i in enumerate(ids)]
        self.running: dict[asyncio.Queue, list[int]] = {}  # queue -> [tokens handed, max_new_tokens]
        self._tick = asyncio.Event()

    def health(self):
        return True, {"status": "ok"}

    def info(self):
        return {}

    async def check_grammars(self, requests):
        pass

    def queue_size(self):
        return 0

    async def run(self) -> None:
        """The batching loop's stand-in: hand out one call's tokens, let the streams run, again."""
        while True:
            if not self.running:
                await self._tick.wait()
                self._tick.clear()
            for q, state in list(self.running.items()):
                for _ in range(min(self.per_call, state[1] - state[0])):
                    q.put_nowait(self._event(state))
                if state[0] == state[1]:
                    del self.running[q]
            await asyncio.sleep(0)

    def _event(self, state: list[int]):
        from dataclasses import replace

        from gaudi_runtime.router.types import FinishReason, GenerationEnd

        state[0] += 1
        ev = self.events[state[0] % len(self.events)]
        if state[0] < state[1]:
            return ev
        return replace(ev, end=GenerationEnd(FinishReason.LENGTH, "x" * state[1], state[1], None))

    async def generate_groups(self, request):
        q: asyncio.Queue = asyncio.Queue()
        self.running[q] = [0, request.stopping.max_new_tokens]
        self._tick.set()
        try:
            while True:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                yield batch
                if batch[-1].end is not None:
                    return
        finally:
            self.running.pop(q, None)

    async def generate(self, request):
        batches = self.generate_groups(request)
        try:
            async for batch in batches:
                for ev in batch:
                    yield ev
        finally:
            await batches.aclose()


def _body(api: str, tokens: int) -> tuple[str, dict]:
    if api == "tgi":
        return "/generate_stream", {"inputs": "the gaudi card", "parameters": {"max_new_tokens": tokens}}
    return "/v1/completions", {"prompt": "the gaudi card", "max_tokens": tokens, "stream": True}


async def client(url: str, api: str, users: int, requests: int, tokens: int) -> None:
    """The load, in the child process: `requests` streams, `users` at a time, each read to its end."""
    import aiohttp

    path, body = _body(api, tokens)
    left = requests

    async def user(session):
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content.iter_any():
                    pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=users)) as session:
        await asyncio.gather(*(user(session) for _ in range(users)))


async def serve_and_load(model_dir: str, api: str, per_call: int, a) -> float:
    """Router CPU seconds per streamed token, for one API and tokens per call."""
    from gaudi_runtime.config import resolve
    from gaudi_runtime.router.server import build_app, start
    from gaudi_runtime.router.tokenizer import RouterTokenizer

    config = resolve(None, {"MODEL_ID": model_dir, "MAX_INPUT_TOKENS": "1024", "MAX_TOTAL_TOKENS": "2048",
                            "MAX_CONCURRENT_REQUESTS": "512"})
    tokenizer = RouterTokenizer.load(model_dir, config.model)
    engine = TickEngine(tokenizer, per_call)
    runner, port = await start(build_app(config, engine, tokenizer), "127.0.0.1", 0)
    ticker = asyncio.ensure_future(engine.run())
    me = ["-m", __spec__.name] if __spec__ is not None else [__file__]  # a module, or a file run by path
    cmd = [sys.executable, *me, "--client", f"http://127.0.0.1:{port}", "--api", api,
           "--users", str(a.users), "--requests", str(a.requests), "--tokens", str(a.tokens)]
    try:
        t0 = os.times()
        proc = await asyncio.create_subprocess_exec(*cmd)
        if await proc.wait() != 0:
            raise RuntimeError(f"the load client failed ({proc.returncode})")
        t1 = os.times()
    finally:
        ticker.cancel()
        await runner.cleanup()
    return ((t1.user - t0.user) + (t1.system - t0.system)) / (a.requests * a.tokens)


def detokenizer_cost(model_dir: str, tokens: int = 20_000) -> float:
    """CPU seconds per token of the incremental detokenizer over random ids, 48 streams at a time."""
    from gaudi_runtime.config import resolve
    from gaudi_runtime.router.detokenizer import IncrementalDetokenizer
    from gaudi_runtime.router.tokenizer import RouterTokenizer

    tok = RouterTokenizer.load(model_dir, resolve(None, {"MODEL_ID": model_dir}).model)
    rng = random.Random(1)
    special = tok.special_ids
    ids = [i for i in (rng.randrange(tok.vocab_size) for _ in range(tokens * 2)) if i not in special][:tokens]
    streams = [IncrementalDetokenizer(tok, prompt_ids=ids[k:k + 5]) for k in range(48)]
    t0 = time.process_time()
    for k, i in enumerate(ids):
        streams[k % 48].add(i)
    return (time.process_time() - t0) / len(ids)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.stream_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=str(DEFAULT_MODEL), help="its tokenizer is used (default: %(default)s)")
    p.add_argument("--users", type=int, default=48)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--per-call", type=int, nargs="+", default=[1, 4], help="tokens a stream gets at once")
    p.add_argument("--api", nargs="+", default=["tgi", "openai"], choices=["tgi", "openai"])
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the child process's role
    a = p.parse_args(argv)
    if a.client:
        asyncio.run(client(a.client, a.api[0], a.users, a.requests, a.tokens))
        return
    out = {}
    for api in a.api:
        for per_call in a.per_call:
            out[f"{api} per_call={per_call}"] = asyncio.run(serve_and_load(a.model_id, api, per_call, a))
    out["detokenizer"] = detokenizer_cost(a.model_id)
    print(json.dumps({k: round(v * 1e6, 2) for k, v in out.items()} | {"unit": "us CPU per token",
                                                                          "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
