"""Returning conversations: long chats that come back after the device's KV cache has forgotten them.

    python -m gaudi_runtime.bench.returning --url http://127.0.0.1:8080 --tokenizer DIR \
        --device-budget 4096 --context-tokens 1024 --message-tokens 64 --output-tokens 32 --turns 3 \
        --json report.json --outputs answers.jsonl

The workload of the KV cache tiers (a host-memory and a disk tier under the device's prefix cache;
bench/kv_offload.sh runs it against each configuration). Each of --conversations conversations
starts with its own context of --context-tokens tokens (a pasted document: no two share a prefix),
then has --turns turns; each turn resends the whole history (context, earlier messages and answers)
plus a new user message of --message-tokens and asks for --output-tokens tokens, greedy
(temperature 0), EOS ignored. Every conversation has its first turn, in order; then the
conversations return, round after round, each round in its own seeded random order, --concurrency
requests in flight. Without --conversations, enough are made that their histories after the first
turn hold --budget-multiple (default 4) times --device-budget tokens (the server's KV cache, set
small with --max-batch-total-tokens; read from /info when the server has one), so a returning
conversation's prefix is no longer on the device.

Phases, for a restart in between (the disk tier):
  all     (default) first turns, then the returning rounds
  build   the same, then the conversations (their answers included) are written to --state
  return  reads --state and sends each conversation's next turn once, in a seeded random order: the
          first returning turn, e.g. after the server restarted on the same disk directory

Prints a summary, then one RESULT line; --json writes the report (bench/kv_offload.sh's table reads
it), --outputs every answer (conversation, turn, text) as JSON lines, to compare two servers'
greedy outputs (`python -m gaudi_runtime.bench.kv_offload_report compare A B`). The server's
/metrics lines whose names mention `kv_offload` or `tier` are printed after the run (METRIC ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from gaudi_runtime.bench import kv_offload_report as report
from gaudi_runtime.bench.loadtest import Planned, Record, prefix_cache_counters, prefix_cache_delta, send
from gaudi_runtime.bench.profiles import Conversation, PromptMaker
from gaudi_runtime.bench.stats import percentile


@dataclass(frozen=True)
class Shape:
    """The sizes of one conversation, in tokens (the answers: max_tokens, EOS ignored)."""

    context_tokens: int
    message_tokens: int
    output_tokens: int
    turns: int

    def history(self, turns: int) -> int:
        """Tokens a conversation holds after `turns` turns (its prompts and answers)."""
        return self.context_tokens + turns * (self.message_tokens + self.output_tokens)


def conversations_needed(budget_tokens: int, shape: Shape, multiple: float = 4) -> int:
    """Fewest conversations whose histories after their first turn hold `multiple` x the device budget."""
    return max(1, math.ceil(multiple * budget_tokens / shape.history(1)))


def make_conversations(maker: PromptMaker, count: int, shape: Shape, seed: int) -> list[Conversation]:
    """`count` conversations, the same for the same seed; each has one user message more than its turns,
    the one a later `--phase return` sends. A numbered opening keeps every context's first block its own."""
    out = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        context = f"Conversation {i}. " + maker.make(rng, shape.context_tokens)[0]
        messages = [maker.make(rng, shape.message_tokens)[0] for _ in range(shape.turns + 1)]
        out.append(Conversation(context, messages, [shape.output_tokens] * (shape.turns + 1)))
    return out


def return_order(count: int, round_: int, seed: int) -> list[int]:
    """The order conversations return in, round `round_` (from 1); round 0, the first turns, is in order."""
    order = list(range(count))
    if round_ > 0:
        random.Random(seed * 7_919 + round_).shuffle(order)
    return order


@dataclass
class Turn:
    """One request of the run: which conversation, which turn (from 0), which round, and its record."""

    conversation: int
    turn: int
    round: int
    record: Record


async def run_round(conversations: list[Conversation], order: list[int], round_: int, concurrency: int,
                    send_one) -> list[Turn]:
    """Each conversation in `order` sends its next turn, `concurrency` at a time; an answer is appended
    to its conversation (a failed turn ends it: the next would send a history nobody answered)."""
    queue, done = list(order), []

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            c = conversations[i]
            turn = len(c.answers)
            p = Planned(len(done), c.prompt(turn), 0, "estimate", c.max_new_tokens[turn], turn=turn + 1)
            rec = await send_one(p)
            done.append(Turn(i, turn, round_, rec))
            if rec.status == "ok":
                c.answers.append(rec.text)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def drive(args, conversations: list[Conversation], rounds: list[int], answered: int) -> dict:
    """Sends the given rounds (0: the first turns), each to the conversations that have `answered`
    answers plus one per round before it, and summarizes them; the server's counters around each."""
    import aiohttp

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await first_model(base, headers)
    turns: list[Turn] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def send_one(p: Planned) -> Record:
            return await send(session, base, "openai", p, model, True, t0, args.timeout, headers)

        windows = {}
        for k, r in enumerate(rounds):
            before, start = await prefix_cache_counters(base, headers), time.perf_counter()
            ids = [i for i in return_order(len(conversations), r, args.seed)
                   if len(conversations[i].answers) == answered + k]
            turns += await run_round(conversations, ids, r, args.concurrency, send_one)
            windows[r] = (time.perf_counter() - start,
                          prefix_cache_delta(before, await prefix_cache_counters(base, headers)))
        elapsed = time.perf_counter() - t0
    return summarize(turns, windows, elapsed, model)


def summarize(turns: list[Turn], windows: dict, elapsed: float, model: str) -> dict:
    """The report (pure): TTFT of first and returning turns, throughput over the run and over the
    returning rounds, the prefix-cache hits of each, and every request."""
    ok = [t for t in turns if t.record.status == "ok"]
    first = [t.record.ttft_ms for t in ok if t.round == 0]
    back = [t.record.ttft_ms for t in ok if t.round > 0]
    back_rounds = [r for r in windows if r > 0]
    back_seconds = sum(windows[r][0] for r in back_rounds)
    back_tokens = sum(t.record.generated_tokens for t in ok if t.round > 0)
    errors: dict[str, int] = {}
    for t in turns:
        if t.record.status != "ok":
            errors[t.record.status] = errors.get(t.record.status, 0) + 1
    return {
        "model": model, "requests": len(turns), "ok": len(ok), "errors": errors, "seconds": elapsed,
        "output_tokens": sum(t.record.generated_tokens for t in ok),
        "prompt_tokens": sum(t.record.prompt_tokens or 0 for t in ok),
        "tokens_per_s": sum(t.record.generated_tokens for t in ok) / elapsed if elapsed else math.nan,
        "returning_tokens_per_s": back_tokens / back_seconds if back_seconds else math.nan,
        "first_ttft_ms": {"p50": percentile(first, 50), "p90": percentile(first, 90), "count": len(first)},
        "returning_ttft_ms": {"p50": percentile(back, 50), "p90": percentile(back, 90), "count": len(back)},
        "prefix_cache": {"first": merge_hits([windows[r][1] for r in windows if r == 0]),
                         "returning": merge_hits([windows[r][1] for r in back_rounds])},
        "turns": [{"conversation": t.conversation, "turn": t.turn, "round": t.round, "status": t.record.status,
                   "ttft_ms": t.record.ttft_ms, "prompt_tokens": t.record.prompt_tokens,
                   "generated_tokens": t.record.generated_tokens, "text": t.record.text} for t in turns],
    }


def merge_hits(deltas: list) -> dict | None:
    """Prefix-cache hits of several windows together (None when the server does not count them)."""
    if not deltas or any(d is None for d in deltas):
        return None
    queries, hits = sum(d["queries"] for d in deltas), sum(d["hits"] for d in deltas)
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else math.nan}


async def first_model(base: str, headers: dict) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(base + "/v1/models", headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def server_info(url: str) -> dict:
    """The server's /info (gaudi-serve's and TGI's), or {} where it has none."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/info", timeout=10) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - vLLM has no /info: the caller gives --device-budget
        return {}


def server_metrics(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
            return r.read().decode()
    except Exception:  # noqa: BLE001 - metrics are extra: the run stands without them
        return ""


def save_state(path: str, shape: Shape, seed: int, conversations: list[Conversation]) -> None:
    state = {"shape": asdict(shape), "seed": seed, "conversations": [asdict(c) for c in conversations]}
    with open(path, "w") as f:
        json.dump(state, f)


def load_state(path: str) -> tuple[Shape, int, list[Conversation]]:
    with open(path) as f:
        state = json.load(f)
    return Shape(**state["shape"]), state["seed"], [Conversation(**c) for c in state["conversations"]]


def device_budget(args) -> int | None:
    """--device-budget, else the KV tokens the server's /info says it holds (gaudi-serve's)."""
    return args.device_budget or server_info(args.url).get("max_batch_total_tokens")


def build_conversations(args) -> tuple[Shape, list[Conversation], int | None]:
    shape = Shape(args.context_tokens, args.message_tokens, args.output_tokens, args.turns)
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    budget = device_budget(args)
    count = args.conversations
    if count is None:
        if budget is None:
            raise SystemExit("give --conversations or --device-budget (the server has no /info to read it from)")
        count = conversations_needed(budget, shape, args.budget_multiple)
    elif budget and count * shape.history(1) < args.budget_multiple * budget:
        print(f"note: {count} conversations hold {count * shape.history(1)} tokens after their first turn, "
              f"less than {args.budget_multiple:g} x the device's {budget}", file=sys.stderr)
    return shape, make_conversations(PromptMaker(tok, args.seed), count, shape, args.seed), budget


def run(args) -> dict:
    """One phase against the server: the report, with the workload's sizes."""
    if args.phase == "return":
        shape, _, conversations = load_state(args.state)
        budget = device_budget(args)
        result = asyncio.run(drive(args, conversations, [shape.turns], shape.turns))
    else:
        shape, conversations, budget = build_conversations(args)
        result = asyncio.run(drive(args, conversations, list(range(shape.turns)), 0))
        if args.phase == "build":
            save_state(args.state, shape, args.seed, conversations)
    held = len(conversations) * shape.history(1)
    return {"tool": "gaudi_runtime.bench.returning", "phase": args.phase, "url": args.url, "seed": args.seed,
            "conversations": len(conversations), "concurrency": args.concurrency, "shape": asdict(shape),
            "device_budget": budget, "history_tokens": held,
            "budget_multiple": held / budget if budget else None, **result}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.returning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server (OpenAI /v1/completions)")
    p.add_argument("--model", default=None, help="the request's model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="model directory whose tokenizer sizes the texts "
                   "(default: sizes estimated from word counts)")
    p.add_argument("--phase", choices=("all", "build", "return"), default="all")
    p.add_argument("--state", default=None, help="build: where to write the conversations; return: read them")
    p.add_argument("--conversations", type=int, default=None,
                   help="default: enough to hold --budget-multiple x --device-budget after the first turn")
    p.add_argument("--device-budget", type=int, default=None,
                   help="KV tokens the server's device holds (default: max_batch_total_tokens of its /info)")
    p.add_argument("--budget-multiple", type=float, default=4.0)
    p.add_argument("--context-tokens", type=int, default=1024, help="each conversation's own opening context")
    p.add_argument("--message-tokens", type=int, default=64, help="each new user message")
    p.add_argument("--output-tokens", type=int, default=32, help="each answer's max_tokens (EOS ignored)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation: the first and the returns")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--api-key", default=None, help="bearer token")
    p.add_argument("--json", dest="json_path", default=None, help="write the report as JSON")
    p.add_argument("--outputs", default=None, help="write every answer as JSON lines (conversation and turn from 0, text)")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.phase in ("build", "return") and not a.state:
        p.error(f"--phase {a.phase} needs --state")
    if a.phase == "return" and not os.path.isfile(a.state):
        p.error(f"--state {a.state}: no such file (write it with --phase build)")
    if a.phase == "build" and not os.path.isdir(os.path.dirname(os.path.abspath(a.state))):
        p.error(f"--state {a.state}: its directory does not exist")
    sizes = (a.context_tokens, a.message_tokens, a.output_tokens, a.turns, a.concurrency, a.conversations or 1)
    if min(sizes) < 1 or a.budget_multiple <= 0:
        p.error("--conversations, --context-tokens, --message-tokens, --output-tokens, --turns, --concurrency "
                "and --budget-multiple must be positive")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, a)
    import aiohttp

    try:
        r = run(a)
    except (OSError, aiohttp.ClientError) as e:  # the server is unreachable or stopped answering
        print(f"error: {a.url}: {e}", file=sys.stderr)
        return 1
    r["tier_metrics"] = report.tier_metric_lines(server_metrics(a.url))
    print(report.render(r))
    print(report.result_line(r))
    for line in r["tier_metrics"]:
        print(f"METRIC {line}")
    if a.json_path:
        report.write_report(r, a.json_path)
    if a.outputs:
        report.write_outputs(r, a.outputs)
    return 0 if r["ok"] == r["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
