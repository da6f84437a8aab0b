"""`gaudi-serve loadtest`: realistic traffic against a TGI- or OpenAI-compatible endpoint.

    gaudi-serve loadtest --url http://127.0.0.1:8080 --api tgi --profile chat --users 8 --requests 200
    gaudi-serve loadtest --url http://127.0.0.1:8080 --api openai --profile constant --rate 4 --duration 60
    gaudi-serve loadtest --url http://127.0.0.1:8080 --profile sweep --sweep-steps 5 --plot sweep.png

Traffic:
  closed loop (--users N)   N virtual users, each sends its next request when the previous one ends
  open loop (--rate R)      requests arrive as a Poisson process of R requests/s, whatever the server does

Profiles:
  constant  fixed lengths (--prompt-tokens 128 --output-tokens 128 unless given); --rate or --users
  chat      chat-like length histograms shipped with the tool (chat-prompt, chat-output); --users or --rate
  sweep     a closed-loop step at --users to find the saturation rate, then open-loop steps at
            1/K .. K/K of it (K = --sweep-steps), or at the given --rates; chat lengths unless given
  multiturn conversations of --turns turns (default 4) behind one shared system prompt of
            --system-tokens tokens (default 1000), each turn sending the whole history (the earlier
            messages and answers) and a new user message of --prompt-tokens (default 100), answered
            with --output-tokens (default 64); --users conversations at a time (closed loop). The
            report gives time to first token by turn number

Every report gives the prefix-cache hit rate (the share of prompt tokens the server found cached)
when the server's /metrics has it (gaudi-serve's and vLLM's counters).

Each step sends --requests requests (default 100) or runs for --duration seconds, whichever ends
first, then waits for the requests in flight. Streaming is used throughout (TGI: /generate_stream;
OpenAI: /v1/completions, or /v1/chat/completions with --api openai-chat, with stream_options.include_usage), so that time to first token (TTFT) and
inter-token latency (ITL, the gap between streamed chunks) are measured as a client sees them.

EOS: with the OpenAI APIs, `ignore_eos: true` is sent only with --ignore-eos. TGI's API has no
per-request switch: start the server with TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN=true to make
every request generate its max_new_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from gaudi_runtime.bench.profiles import (
    TOKENS_PER_WORD,
    Conversation,
    ConversationMaker,
    LengthSpecError,
    PromptMaker,
    parse_length,
    poisson_schedule,
)
from gaudi_runtime.bench.stats import STAT_COLUMNS, fmt, summarize, table, write_json

PROFILE_LENGTHS = {"constant": ("128", "128"), "chat": ("chat-prompt", "chat-output"),
                   "sweep": ("chat-prompt", "chat-output"), "multiturn": ("100", "64")}
# Prefix-cache counters (prompt tokens looked up, found) in /metrics: ours, then vLLM's.
PREFIX_CACHE_COUNTERS = (("gaudi_serve_prefix_cache_queries_total", "gaudi_serve_prefix_cache_hits_total"),
                         ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))


@dataclass
class Planned:
    index: int
    prompt: str
    prompt_tokens: int
    counted_by: str  # tokenizer | estimate (replaced by "server" when the server reports usage)
    max_new_tokens: int
    messages: list[dict] | None = None  # a conversation's turn, for the chat API (else `prompt` is the turn)
    turn: int | None = None  # from 1, in a conversation


@dataclass
class Record:
    index: int
    start_s: float
    status: str = "ok"  # "ok", an HTTP status code, "timeout", "connection" or "stream_error"
    prompt_tokens: int | None = None
    prompt_counted_by: str = ""
    max_new_tokens: int = 0
    generated_tokens: int = 0
    chunks: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    turn: int | None = None
    text: str = ""  # the answer (a conversation's next turn sends it back); not in the JSON report


# ---- one request -------------------------------------------------------------

def request_body(api: str, p: Planned, model: str, ignore_eos: bool) -> tuple[str, dict]:
    """(path, JSON body) of a streaming request for `p` (greedy).

    api: "tgi" (/generate_stream), "openai" (/v1/completions) or "openai-chat" (/v1/chat/completions,
    the prompt as one user message).
    """
    if api == "tgi":
        params = {"max_new_tokens": p.max_new_tokens, "details": True, "do_sample": False}
        return "/generate_stream", {"inputs": p.prompt, "parameters": params, "stream": True}
    body = {"model": model, "max_tokens": p.max_new_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    if api == "openai-chat":
        messages = p.messages or [{"role": "user", "content": p.prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": p.prompt}


def on_event(api: str, data: dict, rec: Record) -> bool:
    """Account one SSE payload; True when it carried generated text (a chunk of tokens)."""
    if "error" in data and not data.get("choices") and "token" not in data:
        rec.status = "stream_error"
        rec.error = str(data.get("error"))[:200]
        return False
    if api == "tgi":
        if "token" not in data:
            return False
        if not data["token"].get("special"):
            rec.text += data["token"].get("text") or ""
        rec.generated_tokens += 1
        details = data.get("details")
        if details:
            rec.generated_tokens = details.get("generated_tokens", rec.generated_tokens)
            rec.finish_reason = details.get("finish_reason")
        return True
    choices = data.get("choices") or []
    if choices and api == "openai-chat" and not (choices[0].get("delta") or {}).get("content"):
        # a chunk without text (the role alone, the finish reason): no token seen by the client
        if choices[0].get("finish_reason"):
            rec.finish_reason = choices[0]["finish_reason"]
        choices = []
    if choices:
        rec.text += choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
        rec.generated_tokens += 1  # one chunk, one token, unless the server reports usage (below)
        if choices[0].get("finish_reason"):
            rec.finish_reason = choices[0]["finish_reason"]
    usage = data.get("usage")
    if usage:
        rec.generated_tokens = usage.get("completion_tokens", rec.generated_tokens)
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens, rec.prompt_counted_by = usage["prompt_tokens"], "server"
    return bool(choices)


async def send(session, base: str, api: str, p: Planned, model: str, ignore_eos: bool, t0: float,
               timeout_s: float, headers: dict) -> Record:
    import aiohttp

    rec = Record(index=p.index, start_s=time.perf_counter() - t0, prompt_tokens=p.prompt_tokens,
                 prompt_counted_by=p.counted_by, max_new_tokens=p.max_new_tokens, turn=p.turn)
    path, body = request_body(api, p, model, ignore_eos)
    start = time.perf_counter()
    last = None
    try:
        async with session.post(base + path, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                rec.status = str(r.status)
                rec.error = (await r.text())[:200]
                return rec
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *frames, buf = buf.split(b"\n")
                for raw in frames:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    data = json.loads(payload)
                    now = time.perf_counter()
                    if on_event(api, data, rec):
                        rec.chunks += 1
                        if last is None:
                            rec.ttft_ms = (now - start) * 1000
                        else:
                            rec.itl_ms.append((now - last) * 1000)
                        last = now
            rec.e2e_ms = (time.perf_counter() - start) * 1000
    except asyncio.TimeoutError:
        rec.status, rec.error = "timeout", f"no complete answer within {timeout_s}s"
    except aiohttp.ClientError as e:
        rec.status, rec.error = "connection", str(e)[:200]
    if rec.status == "ok" and rec.chunks == 0:
        rec.status, rec.error = "stream_error", "the stream ended without tokens"
    return rec


# ---- a step: closed or open loop ---------------------------------------------

@dataclass
class Workload:
    prompt_dist: object
    output_dist: object
    maker: PromptMaker
    seed: int

    def plan(self, index: int) -> Planned:
        rng = random.Random(self.seed * 1_000_003 + index)
        n_in = self.prompt_dist.sample(rng)
        n_out = self.output_dist.sample(rng)
        prompt, counted, how = self.maker.make(rng, n_in)
        return Planned(index, prompt, counted, how, n_out)


@dataclass
class ConversationWorkload:
    """--profile multiturn: `prompt_dist` is the length of each new user message."""

    prompt_dist: object
    output_dist: object
    conversations: ConversationMaker

    def plan(self, conversation: Conversation, turn: int, index: int) -> Planned:
        prompt = conversation.prompt(turn)
        tokenizer = self.conversations.maker.tokenizer
        if tokenizer is not None:
            counted, how = len(tokenizer(prompt).input_ids), "tokenizer"
        else:
            counted, how = round(len(prompt.split()) * TOKENS_PER_WORD), "estimate"
        return Planned(index, prompt, counted, how, conversation.max_new_tokens[turn],
                       messages=conversation.messages(turn), turn=turn + 1)


async def run_step(args, workload: Workload | ConversationWorkload, *, users: int | None = None,
                   rate: float | None = None, label: str = "", model: str = "tgi", first_index: int = 0) -> dict:
    import aiohttp
    from tqdm import tqdm

    n = args.requests
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    records: list[Record] = []
    bar = tqdm(total=n if n != math.inf else None, desc=label or "loadtest", unit="req",
               disable=args.no_progress, file=sys.stderr)
    errors: dict[str, int] = {}

    def done(rec: Record) -> Record:
        records.append(rec)
        if rec.status != "ok":
            errors[rec.status] = errors.get(rec.status, 0) + 1
            bar.set_postfix(errors=sum(errors.values()))
        bar.update(1)
        return rec

    base = args.url.rstrip("/")
    cache_before = await prefix_cache_counters(base, headers)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def go(p: Planned) -> Record:
            return done(await send(session, base, args.api, p, model, args.ignore_eos, t0, args.timeout, headers))

        if isinstance(workload, ConversationWorkload):
            await _conversations(args, workload, users, go, t0, first_index)
        elif users is not None:
            await _closed_loop(args, users, lambda i: go(workload.plan(first_index + i)), t0)
        else:
            await _open_loop(args, rate, lambda i: go(workload.plan(first_index + i)), t0, first_index)
        elapsed = time.perf_counter() - t0
    bar.close()
    step = summarize_step(records, elapsed, users=users, rate=rate)
    step["prefix_cache"] = prefix_cache_delta(cache_before, await prefix_cache_counters(base, headers))
    return step


async def _closed_loop(args, users: int, go, t0: float) -> None:
    """`users` virtual users, each sending its next request when its previous one ended."""
    n, duration = args.requests, args.duration
    counter = iter(range(n) if n != math.inf else _count())

    async def user() -> None:
        for i in counter:
            if duration is not None and time.perf_counter() - t0 >= duration:
                return
            await go(i)

    await asyncio.gather(*(user() for _ in range(users)))


async def _open_loop(args, rate: float, go, t0: float, first_index: int) -> None:
    """Requests arriving as a Poisson process of `rate` requests/s."""
    n, duration = args.requests, args.duration
    rng = random.Random(args.seed * 7919 + first_index)
    count = n if n != math.inf else 10**9
    schedule = poisson_schedule(rate, count, rng, duration) if duration is not None else \
        poisson_schedule(rate, count, rng)

    async def at(i: int, when: float) -> None:
        delay = t0 + when - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await go(i)

    await asyncio.gather(*(at(i, when) for i, when in enumerate(schedule)))


async def _conversations(args, workload: ConversationWorkload, users: int, go, t0: float, first_index: int) -> None:
    """`users` virtual users, each holding one conversation at a time, turn after turn; a turn that
    fails ends its conversation. Stops after --requests requests (turns) or --duration seconds."""
    n, duration = args.requests, args.duration
    requests, conversations = iter(range(n) if n != math.inf else _count()), _count()

    async def user() -> None:
        while True:
            conversation = workload.conversations.conversation(first_index + next(conversations))
            for turn in range(conversation.turns):
                i = next(requests, None)
                if i is None or duration is not None and time.perf_counter() - t0 >= duration:
                    return
                rec = await go(workload.plan(conversation, turn, first_index + i))
                if rec.status != "ok":
                    break
                conversation.answers.append(rec.text)

    await asyncio.gather(*(user() for _ in range(users)))


async def prefix_cache_counters(base: str, headers: dict) -> tuple[float, float] | None:
    """(prompt tokens looked up, found cached) so far, from the server's /metrics; None without them."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics", headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return parse_prefix_cache_counters(text)


def parse_prefix_cache_counters(metrics_text: str) -> tuple[float, float] | None:
    """The prefix-cache counters of a Prometheus text page, summed over their labels."""
    for queries, hits in PREFIX_CACHE_COUNTERS:
        found = {queries: 0.0, hits: 0.0}
        seen = False
        for line in metrics_text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[-1])
                seen = True
        if seen:
            return found[queries], found[hits]
    return None


def prefix_cache_delta(before, after) -> dict | None:
    """What a step added to the counters: tokens looked up, found, and the hit rate (None: not exposed)."""
    if before is None or after is None:
        return None
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else math.nan}


def _count():
    i = 0
    while True:
        yield i
        i += 1


def summarize_step(records: list[Record], elapsed: float, users: int | None = None,
                   rate: float | None = None) -> dict:
    records = sorted(records, key=lambda r: r.index)
    ok = [r for r in records if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in records:
        if r.status != "ok":
            errors[r.status] = errors.get(r.status, 0) + 1
    generated = sum(r.generated_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    itl = [g for r in ok for g in r.itl_ms]
    tpot = [(r.e2e_ms - r.ttft_ms) / (r.generated_tokens - 1) for r in ok
            if r.generated_tokens > 1 and r.ttft_ms is not None]
    counted = sorted({r.prompt_counted_by for r in ok}) or ["-"]
    return {
        "mode": "closed" if users is not None else "open",
        "users": users,
        "rate": rate,
        "requests": {"sent": len(records), "ok": len(ok), "errors": dict(sorted(errors.items())),
                     "failed": len(records) - len(ok)},
        "duration_s": elapsed,
        "throughput": {"requests_per_s": len(ok) / elapsed if elapsed else math.nan,
                       "output_tokens_per_s": generated / elapsed if elapsed else math.nan,
                       "input_tokens_per_s": prompt / elapsed if elapsed else math.nan},
        "tokens": {"prompt": prompt, "prompt_counted_by": "+".join(counted), "generated": generated,
                   "requested": sum(r.max_new_tokens for r in ok)},
        "ttft_ms": summarize(r.ttft_ms for r in ok if r.ttft_ms is not None),
        "itl_ms": summarize(itl),
        "tpot_ms": summarize(tpot),
        "e2e_ms": summarize(r.e2e_ms for r in ok),
        "prompt_tokens": summarize(r.prompt_tokens for r in ok if r.prompt_tokens is not None),
        "output_tokens": summarize(r.generated_tokens for r in ok),
        "ttft_by_turn": {str(t): summarize(r.ttft_ms for r in ok if r.turn == t and r.ttft_ms is not None)
                         for t in sorted({r.turn for r in ok if r.turn is not None})},
        "records": [_record_json(r) for r in records],
    }


def _record_json(r: Record) -> dict:
    d = asdict(r)
    del d["text"]
    d["itl_ms"] = summarize(r.itl_ms)["mean"] if r.itl_ms else None  # per-request mean, not every gap
    return d


# ---- the whole run -----------------------------------------------------------

def sweep_rates(saturation_rps: float, steps: int) -> list[float]:
    """Open-loop rates from saturation/steps up to the saturation rate, evenly spaced."""
    if saturation_rps <= 0 or not math.isfinite(saturation_rps):
        raise ValueError(f"cannot sweep below a saturation rate of {saturation_rps}")
    return [saturation_rps * (i + 1) / steps for i in range(steps)]


async def resolve_model(args) -> str:
    """--model, else what the server calls its model (/v1/models for OpenAI, /info for TGI), else "tgi"."""
    if args.model:
        return args.model
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    openai = args.api.startswith("openai")
    path = "/v1/models" if openai else "/info"
    try:
        async with aiohttp.ClientSession() as s, s.get(args.url.rstrip("/") + path, headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.json()
            return data["data"][0]["id"] if openai else data["model_id"]
    except Exception:  # noqa: BLE001 - any answer without a model id: fall back to TGI's name
        return "tgi"


async def run(args, workload: Workload) -> dict:
    model = await resolve_model(args)
    steps = []
    if args.profile == "sweep":
        rates = args.rates
        if not rates:
            sat = await run_step(args, workload, users=args.users, label=f"saturation ({args.users} users)",
                                 model=model)
            sat["label"] = "saturation"
            steps.append(sat)
            rates = sweep_rates(sat["throughput"]["requests_per_s"], args.sweep_steps)
        for k, r in enumerate(rates):
            s = await run_step(args, workload, rate=r, label=f"rate {r:.2f}/s ({k + 1}/{len(rates)})",
                               model=model, first_index=(k + 1) * 1_000_000)
            s["label"] = f"rate {r:.2f}/s"
            steps.append(s)
    elif args.rate is not None:
        s = await run_step(args, workload, rate=args.rate, label=f"{args.profile} at {args.rate}/s", model=model)
        s["label"] = f"rate {args.rate}/s"
        steps.append(s)
    else:
        s = await run_step(args, workload, users=args.users, label=f"{args.profile}, {args.users} users",
                           model=model)
        s["label"] = f"{args.users} users"
        steps.append(s)
    return {
        "tool": "gaudi-serve loadtest",
        "url": args.url,
        "api": args.api,
        "model": model,
        "profile": args.profile,
        "prompt_tokens": workload.prompt_dist.spec,
        "output_tokens": workload.output_dist.spec,
        "max_prompt_tokens": workload.prompt_dist.cap,
        "max_output_tokens": workload.output_dist.cap,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        **({"turns": args.turns, "system_tokens": args.system_tokens} if args.profile == "multiturn" else {}),
        "steps": steps,
    }


def render(report: dict) -> str:
    out = [f"{report['api']} API at {report['url']} (model {report['model']}), profile {report['profile']}: "
           f"prompt tokens {report['prompt_tokens']}, output tokens {report['output_tokens']}"]
    if "turns" in report:
        out[0] += (f"; conversations of {report['turns']} turns behind a {report['system_tokens']}-token system "
                   "prompt, each turn sending the whole history (prompt tokens: each new user message)")
    summary_rows = []
    for s in report["steps"]:
        req = s["requests"]
        errs = ", ".join(f"{k}: {v}" for k, v in req["errors"].items()) or "-"
        summary_rows.append([s["label"], str(req["sent"]), str(req["ok"]), errs, fmt(s["duration_s"]),
                             fmt(s["throughput"]["requests_per_s"]), fmt(s["throughput"]["output_tokens_per_s"], 1),
                             fmt(s["ttft_ms"]["p50"], 1), fmt(s["itl_ms"]["p50"], 1), fmt(s["e2e_ms"]["p50"], 1)])
        rows = []
        for name, key in (("TTFT (ms)", "ttft_ms"), ("ITL (ms)", "itl_ms"), ("TPOT (ms)", "tpot_ms"),
                          ("E2E latency (ms)", "e2e_ms"), ("Prompt tokens", "prompt_tokens"),
                          ("Output tokens", "output_tokens")):
            rows.append([name, *(fmt(s[key][c], 1) for c in STAT_COLUMNS)])
        out.append(f"\n{s['label']}: {req['ok']}/{req['sent']} ok, errors: {errs}; {fmt(s['duration_s'])} s, "
                   f"{fmt(s['throughput']['requests_per_s'])} req/s, "
                   f"{fmt(s['throughput']['output_tokens_per_s'], 1)} output tokens/s, "
                   f"{fmt(s['throughput']['input_tokens_per_s'], 1)} input tokens/s "
                   f"(prompt tokens counted by {s['tokens']['prompt_counted_by']})")
        out.append(table(["Metric", "Mean", "Min", "Max", "p50", "p90", "p99"], rows))
        out.extend(_render_cache_and_turns(s))
    if len(report["steps"]) > 1:
        out.append("\nSummary")
        out.append(table(["Step", "Sent", "OK", "Errors", "Seconds", "Req/s", "Out tok/s", "TTFT p50",
                          "ITL p50", "E2E p50"], summary_rows))
    return "\n".join(out)


def _render_cache_and_turns(step: dict) -> list[str]:
    """The prefix-cache hit rate, and TTFT by turn (multiturn), of one step."""
    out = []
    cache = step.get("prefix_cache")
    if cache is None:
        out.append("prefix cache: not reported by the server")
    else:
        out.append(f"prefix cache: {fmt(100 * cache['hit_rate'], 1)}% of prompt tokens found cached "
                   f"({cache['hits']:.0f} of {cache['queries']:.0f})")
    by_turn = step.get("ttft_by_turn") or {}
    if by_turn:
        rows = [[turn, str(st["count"]), *(fmt(st[c], 1) for c in ("mean", "p50", "p90", "p99"))]
                for turn, st in by_turn.items()]
        out.append(table(["Turn", "Requests", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99"], rows))
    return out


def plot(report: dict, path: str) -> None:
    """Latency against achieved output throughput, one point per step (PNG via the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tput(s: dict) -> float:
        return s["throughput"]["output_tokens_per_s"]

    steps = sorted((s for s in report["steps"] if s["requests"]["ok"]), key=tput)
    lines = [s for s in steps if s.get("label") != "saturation"] or steps
    marks = [s for s in steps if s not in lines]  # the sweep's closed-loop saturation step
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, series in ((a1, (("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p90", "TTFT p90"),
                             ("itl_ms", "p50", "ITL p50"), ("itl_ms", "p90", "ITL p90"))),
                       (a2, (("e2e_ms", "p50", "E2E p50"), ("e2e_ms", "p90", "E2E p90")))):
        for key, q, name in series:
            line, = ax.plot([tput(s) for s in lines], [s[key][q] for s in lines], marker="o", label=name)
            if marks:
                ax.plot([tput(s) for s in marks], [s[key][q] for s in marks], marker="x", linestyle="",
                        color=line.get_color())
        for s in steps:
            ax.annotate(s["label"], (tput(s), s[series[0][0]][series[0][1]]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_title("time to first token, inter-token latency")
    a2.set_title("end-to-end latency")
    fig.suptitle(f"{report['model']} - {report['profile']} ({report['prompt_tokens']} in, "
                 f"{report['output_tokens']} out)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def local_model_dir(url: str, api_key: str | None = None) -> str | None:
    """The server's model directory when it is on this machine (TGI's /info model_id), for its tokenizer."""
    import os
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/info",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            model_id = json.loads(r.read()).get("model_id") or ""
    except Exception:  # noqa: BLE001 - no /info (not TGI-like), unreachable: estimate instead
        return None
    if os.path.isdir(model_id) and any(os.path.exists(os.path.join(model_id, f))
                                       for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return model_id
    return None


def _rates(s: str) -> list[float]:
    vals = [float(x) for x in s.split(",") if x.strip()]
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive numbers, comma-separated")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaudi-serve loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--api", choices=("tgi", "openai", "openai-chat"), default="tgi",
                   help="tgi: /generate_stream; openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--profile", choices=("chat", "constant", "sweep", "multiturn"), default="chat")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--system-tokens", type=int, default=1000,
                   help="multiturn: tokens of the system prompt every conversation starts with")
    p.add_argument("--users", type=int, default=None, help="closed loop: virtual users (default 4)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests/s")
    p.add_argument("--rates", type=_rates, default=None, help="sweep: these open-loop rates (comma-separated)")
    p.add_argument("--sweep-steps", type=int, default=5, help="sweep: open-loop steps below saturation")
    p.add_argument("--requests", type=int, default=None, help="requests per step (default 100 without --duration)")
    p.add_argument("--duration", type=float, default=None, help="seconds per step")
    p.add_argument("--prompt-tokens", default=None, help="length spec (N, uniform:LO:HI, normal:M:SD, "
                   "lognormal:MEDIAN:SIGMA, choice:A,B, chat-prompt)")
    p.add_argument("--output-tokens", default=None, help="length spec of max_new_tokens (as --prompt-tokens; "
                   "chat-output)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="clip prompt lengths to this")
    p.add_argument("--max-output-tokens", type=int, default=None, help="clip output lengths to this")
    p.add_argument("--tokenizer", default=None, help="tokenizer (model dir or hub id) for exact prompt lengths "
                   "(default: the server's model directory when /info names one on this machine; otherwise "
                   "lengths are estimated from word counts)")
    p.add_argument("--model", default=None, help="OpenAI model name (default: the first of /v1/models)")
    p.add_argument("--ignore-eos", action="store_true", help="OpenAI APIs: send ignore_eos: true")
    p.add_argument("--api-key", default=None, help="bearer token")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the report as JSON ('-': stdout)")
    p.add_argument("--plot", default=None, help="PNG of latency vs throughput, one point per step")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.users is not None and a.rate is not None:
        p.error("give --users (closed loop) or --rate (open loop), not both")
    if a.profile == "sweep" and a.rate is not None:
        p.error("--profile sweep takes --rates (or finds them), not --rate")
    if a.profile == "multiturn" and a.rate is not None:
        p.error("--profile multiturn runs --users conversations at a time (closed loop), not --rate")
    if a.turns < 1 or a.system_tokens < 1:
        p.error("--turns and --system-tokens must be positive")
    if a.users is None:
        a.users = 4
    if a.users < 1 or a.sweep_steps < 1 or (a.rate is not None and a.rate <= 0):
        p.error("--users, --sweep-steps and --rate must be positive")
    if a.requests is not None and a.requests < 1 or a.duration is not None and a.duration <= 0:
        p.error("--requests and --duration must be positive")
    if a.requests is None:
        a.requests = 100 if a.duration is None else math.inf
    if a.plot:
        try:
            import matplotlib  # noqa: F401 - fail now, not after the whole run
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'gaudi-serve[bench]'")
    default_in, default_out = PROFILE_LENGTHS[a.profile]
    try:
        prompt_dist = parse_length(a.prompt_tokens or default_in, a.max_prompt_tokens)
        output_dist = parse_length(a.output_tokens or default_out, a.max_output_tokens)
    except LengthSpecError as e:
        p.error(str(e))
    tok = None
    source = a.tokenizer or local_model_dir(a.url, a.api_key)
    if source:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source)
    else:
        print(f"note: prompt lengths are estimated ({TOKENS_PER_WORD} tokens per word); give --tokenizer "
              "for exact ones", file=sys.stderr)
    maker = PromptMaker(tok, a.seed)
    if a.profile == "multiturn":
        workload = ConversationWorkload(prompt_dist, output_dist, ConversationMaker(
            maker, a.system_tokens, prompt_dist, output_dist, a.turns, a.seed))
    else:
        workload = Workload(prompt_dist, output_dist, maker, a.seed)
    report = asyncio.run(run(a, workload))
    print(render(report))
    if a.json_path:
        write_json(report, a.json_path)
    if a.plot:
        plot(report, a.plot)
        print(f"plot written to {a.plot}")
    return 0
