"""Chat streams among long prompts: what a chat user feels while someone else's long prompt is prefilled.

    python -m gaudi_runtime.bench.mixed --url http://127.0.0.1:8080 --model NAME --tokenizer DIR \
        --chat-streams 8 --long-prompt 1536 --long-every 1.5 --duration 60

`--chat-streams` users each stream one /v1/completions request after another (short prompt, a fixed
number of tokens, EOS ignored); meanwhile a long prompt arrives every `--long-every` seconds, whatever
the server's state (open loop). After `--warmup` seconds, the gaps between a chat stream's tokens,
the chat tokens per second and the long prompts' time to first token are recorded until
`--duration` ends. Prints one RESULT line (milliseconds): the gap p50/p99/max is the pause a chat
user sees; the long prompts' TTFT is what chunking a prompt costs its own sender.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp

from gaudi_runtime.bench.stats import percentile


@dataclass
class Window:
    """What is recorded, and from when to when (time.perf_counter())."""

    start: float
    end: float
    chat_gaps: list[float] = field(default_factory=list)
    chat_tokens: int = 0
    long_ttft: list[float] = field(default_factory=list)

    def inside(self, t: float) -> bool:
        return self.start <= t <= self.end


def summary(w: Window) -> dict:
    """The RESULT fields (pure): chat gap percentiles and maximum, chat tokens/s, long TTFT p50."""
    ms = [g * 1000 for g in w.chat_gaps]
    ttft = [t * 1000 for t in w.long_ttft]
    return {"chat_gap_p50_ms": percentile(ms, 50), "chat_gap_p99_ms": percentile(ms, 99),
            "chat_gap_max_ms": max(ms, default=float("nan")),
            "chat_tokens_per_s": w.chat_tokens / (w.end - w.start),
            "long_ttft_p50_ms": percentile(ttft, 50), "long_requests": len(ttft)}


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> list[float]:
    """One streaming completion; the arrival time of each token's chunk."""
    times = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"/v1/completions answered {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.perf_counter())
    return times


async def chat_user(session, url: str, body: dict, prompts: Iterator[str], w: Window) -> None:
    while time.perf_counter() < w.end:
        times = await stream(session, url, {**body, "prompt": next(prompts)})
        w.chat_tokens += sum(1 for t in times if w.inside(t))
        w.chat_gaps += [b - a for a, b in zip(times, times[1:], strict=False) if w.inside(a) and w.inside(b)]


async def long_prompt(session, url: str, body: dict, w: Window) -> None:
    sent = time.perf_counter()
    times = await stream(session, url, body)
    if times and w.inside(sent):
        w.long_ttft.append(times[0] - sent)


def random_prompts(tokenizer_dir: str, count: int, length: int, rng: random.Random) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tok.decode([rng.randrange(3, tok.vocab_size) for _ in range(length)]) for _ in range(count)]


async def run(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    base = {"model": a.model, "temperature": 0, "ignore_eos": True}
    longs = int(a.duration / a.long_every) + 1
    # Shared and cycled: a fast server (a tiny model) can answer more chat requests than were drawn.
    chats = itertools.cycle(random_prompts(a.tokenizer, a.chat_streams * 200, a.chat_prompt, rng))
    long_prompts = random_prompts(a.tokenizer, longs, a.long_prompt, rng)
    now = time.perf_counter()
    w = Window(start=now + a.warmup, end=now + a.duration)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        chat = {**base, "max_tokens": a.chat_output}
        users = [asyncio.create_task(chat_user(session, a.url, chat, chats, w)) for _ in range(a.chat_streams)]
        arrivals = []
        for prompt in long_prompts:
            if time.perf_counter() >= w.end:
                break
            body = {**base, "prompt": prompt, "max_tokens": a.long_output}
            arrivals.append(asyncio.create_task(long_prompt(session, a.url, body, w)))
            await asyncio.sleep(a.long_every)  # the open-loop arrival schedule itself
        await asyncio.gather(*users, *arrivals)
    return summary(w)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="the model name the server answers to")
    p.add_argument("--tokenizer", required=True, help="directory whose tokenizer makes the random prompts")
    p.add_argument("--chat-streams", type=int, default=8)
    p.add_argument("--chat-prompt", type=int, default=64)
    p.add_argument("--chat-output", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-every", type=float, default=1.5)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds not recorded at the start")
    p.add_argument("--seed", type=int, default=0)
    result = asyncio.run(run(p.parse_args(argv)))
    print("RESULT " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
