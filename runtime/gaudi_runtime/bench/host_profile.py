"""Where the host's time goes while a server runs: a py-spy profile, sorted into the engine's parts.

    py-spy record --pid LAUNCHER_PID --subprocesses --nonblocking --rate 100 --format raw -o prof.txt
    python -m gaudi_runtime.bench.host_profile prof.txt --rate 100 \
        --metrics-before before.txt --metrics-after after.txt

`py-spy --format raw` writes one line per distinct stack, "frame;frame;... count", with a
`process PID:"cmdline"` frame per process level when --subprocesses is on. Each stack is given to
the router, a shard or the launcher by that command line, then to the first category whose marker
(a file or function name) it contains, so the order of CATEGORIES goes from the most specific part
(a forward pass, detokenization) to the most general (the event loop). py-spy leaves out idle
threads, so a sample is busy time: on a CPU, or ready and waiting for one (on a machine with more
work than cores, more than the CPU time the kernel counts); seconds = samples / rate.

The router's /metrics before and after the profiled load give the denominators: output tokens and
decode calls, for a cost per token and per call.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# (role, category, markers): a stack of `role` falls into the first category one of whose markers it contains.
CATEGORIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("router", "detokenization", ("router/detokenizer.py", "RouterTokenizer.decode")),
    ("router", "tokenization + validation", ("router/tokenizer.py", "router/validation.py",
                                              "router/openai_validation.py", "router/request_models.py",
                                              "pydantic", "tokenizers/", "transformers/tokenization")),
    ("router", "SSE writes", ("router/sse.py", "aiohttp/web_response.py", "aiohttp/http_writer.py",
                              "_SelectorSocketTransport.write")),
    ("router", "gRPC calls + messages", ("router/client.py", "grpc/", "google/protobuf", "generate_pb2")),
    ("router", "batching loop", ("router/batching.py", "router/scheduler.py", "router/live_requests.py",
                                 "router/blocks.py", "router/prefix_cache.py", "router/engine_metrics.py")),
    ("router", "output processing (stops, events)", ("router/output.py",)),
    ("router", "metrics", ("prometheus_client",)),
    ("router", "HTTP handlers + response JSON", ("aiohttp/", "router/openai_api.py", "router/tgi_api.py",
                                                 "router/inference.py", "router/routes.py",
                                                 "router/http_common.py", "router/response_models.py",
                                                 "router/engine.py", "json/")),
    ("shard", "forward pass (decode)", ("decode_step (gaudi_runtime/shard/steps.py",)),
    ("shard", "forward pass (prefill)", ("prefill_step (", "prefill_context_step (", "prefill_images_step (",
                                         "mixed_step (")),
    # py-spy sometimes reads a stack cut short, without the runner's frames above the model's.
    ("shard", "forward pass (stack cut short)", ("gaudi_runtime/layers/", "gaudi_runtime/models/",
                                                 "gaudi_runtime/device/")),
    ("shard", "sampling", ("shard/sampling.py", "shard/step_sampling.py")),
    ("shard", "batch bookkeeping (outside the forward pass)", ("shard/runner.py", "shard/inputs.py",
                                                                "shard/batch.py")),
    ("shard", "gRPC + messages", ("to_generations", "shard/servicer.py", "shard/call_order.py", "grpc/",
                                  "google/protobuf", "generate_pb2")),
]
# Stacks told apart by their innermost frame. The event loop's own: a callback written in C ran
# (gRPC's completion callbacks with their protobuf (de)serialization, task wake-ups), with no Python
# frame of its own. A thread's bare run(): gRPC's completion-queue poller thread, all C.
LEAF_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("event loop: C callbacks (gRPC completions, protobuf, wake-ups)",
     ("Handle._run (asyncio/events.py", "BaseEventLoop._run_once (asyncio/base_events.py")),
    ("event loop: epoll", ("EpollSelector.select (selectors.py", "_BaseSelectorImpl")),
    ("gRPC poller thread (C)", ("Thread.run (threading.py",)),
]
OTHER = "other"
_PROCESS = re.compile(r'^process \d+:"(.*)"$')


@dataclass
class Row:
    role: str
    category: str
    samples: int


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) stacks: [(frames from the root, count)]."""
    stacks = []
    for line in text.splitlines():
        stack, sep, count = line.rstrip().rpartition(" ")
        if sep and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def role_of(frames: list[str]) -> str:
    """router, shard or launcher, from the innermost `process` frame's command line."""
    cmdlines = [m.group(1) for f in frames if (m := _PROCESS.match(f))]
    cmd = cmdlines[-1] if cmdlines else ""
    if re.search(r"\bcli router\b|gaudi-serve router\b", cmd):
        return "router"
    if re.search(r"\bcli shard\b|gaudi-serve shard\b", cmd):
        return "shard"
    return "launcher" if "launch" in cmd else "other process"


def category_of(role: str, frames: list[str]) -> str:
    stack = ";".join(frames)
    for r, category, markers in CATEGORIES:
        if r == role and any(m in stack for m in markers):
            return category
    for category, leaves in LEAF_CATEGORIES:
        if frames and frames[-1].startswith(leaves):
            return category
    return OTHER


def breakdown(stacks: list[tuple[list[str], int]]) -> list[Row]:
    """Samples per (role, category), the largest first within each role (router, shard, others)."""
    counts: Counter[tuple[str, str]] = Counter()
    for frames, n in stacks:
        role = role_of(frames)
        counts[(role, category_of(role, frames))] += n
    order = {"router": 0, "shard": 1}
    keys = sorted(counts, key=lambda k: (order.get(k[0], 2), k[0], -counts[k]))
    return [Row(role, category, counts[(role, category)]) for role, category in keys]


def metric_total(text: str, sample: str, **labels: str) -> float:
    """The sum of `sample` (its exposed name, e.g. `..._total`, `..._sum`) over series with `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def load_counts(before: str, after: str) -> dict[str, float]:
    """Output tokens, decode calls and the shards' forward+sampling seconds between two /metrics scrapes."""
    def delta(sample: str, **labels: str) -> float:
        return metric_total(after, sample, **labels) - metric_total(before, sample, **labels)

    return {"tokens": delta("tgi_request_generated_tokens_sum"),
            # The router's TGI-named counters carry no `_total` suffix; a standard counter would.
            "decode_calls": delta("tgi_batch_inference_count", method="decode")
            + delta("tgi_batch_inference_count_total", method="decode"),
            "forward_s": delta("tgi_batch_forward_duration_sum", method="decode")
            + delta("tgi_batch_forward_duration_sum", method="prefill")}


def render(rows: list[Row], rate_hz: float, counts: dict[str, float] | None = None) -> str:
    """A markdown table: busy seconds, share of the process, microseconds per output token, ms per decode call."""
    per_role = Counter()
    for r in rows:
        per_role[r.role] += r.samples
    tokens = (counts or {}).get("tokens") or 0
    calls = (counts or {}).get("decode_calls") or 0
    lines = ["| process | part | busy s | share of process | µs / output token | ms / decode call |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        seconds = r.samples / rate_hz
        per_token = f"{1e6 * seconds / tokens:.0f}" if tokens else "n/a"
        per_call = f"{1e3 * seconds / calls:.2f}" if calls else "n/a"
        lines.append(f"| {r.role} | {r.category} | {seconds:.2f} | {100 * r.samples / per_role[r.role]:.1f}% "
                     f"| {per_token} | {per_call} |")
    for role, n in per_role.items():
        per_token = f"{1e6 * n / rate_hz / tokens:.0f}" if tokens else "n/a"
        lines.append(f"| {role} | **all** | {n / rate_hz:.2f} | 100% | {per_token} | "
                     f"{f'{1e3 * n / rate_hz / calls:.2f}' if calls else 'n/a'} |")
    if counts:
        lines.append(f"\n{tokens:.0f} output tokens, {calls:.0f} decode calls; the shards' own forward+sampling "
                     f"timer (tgi_batch_forward_duration, decode and prefill): {counts['forward_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.host_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", help="py-spy record --format raw output")
    p.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (samples per second)")
    p.add_argument("--metrics-before", help="the router's /metrics scraped before the load")
    p.add_argument("--metrics-after", help="the router's /metrics scraped after the load")
    a = p.parse_args(argv)
    with open(a.raw) as f:
        rows = breakdown(parse_raw(f.read()))
    counts = None
    if a.metrics_before and a.metrics_after:
        with open(a.metrics_before) as b, open(a.metrics_after) as f:
            counts = load_counts(b.read(), f.read())
    print(render(rows, a.rate, counts))


if __name__ == "__main__":
    main()
