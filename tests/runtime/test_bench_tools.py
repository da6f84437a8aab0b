"""`gaudi-serve benchmark` and `gaudi-serve loadtest` against shards and a server started here, on the tiny model.

Small settings throughout: the machine is shared. What is checked is the reports' structure and
that their numbers agree with each other and with what was asked, not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from gaudi_runtime import cli
from gaudi_runtime.bench import mixed
from tests.runtime.launched import launch

pytestmark = pytest.mark.slow

STATS = ("count", "mean", "min", "max", "p50", "p90", "p99")
MAX_INPUT = 64


def assert_ordered(s: dict, what: str = "") -> None:
    assert set(STATS) <= set(s), what
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (what, s)
    assert s["min"] <= s["mean"] <= s["max"], (what, s)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The real runtime, EOS ignored so that every request generates its max_new_tokens."""
    srv = launch(tiny_model_dir, tmp_path_factory.mktemp("bench-server"), "--dtype", "float32",
                 "--max-input-tokens", str(MAX_INPUT), "--max-total-tokens", "128", "--max-batch-size", "8",
                 env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def loadtest(tmp_path, *args: str) -> dict:
    out = tmp_path / "report.json"
    assert cli.main(["loadtest", *args, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def check_step(step: dict) -> None:
    req = step["requests"]
    assert req["sent"] == req["ok"] + sum(req["errors"].values()) == len(step["records"])
    assert req["failed"] == sum(req["errors"].values())
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "prompt_tokens", "output_tokens"):
        if step[key]["count"]:
            assert_ordered(step[key], key)
    ok = [r for r in step["records"] if r["status"] == "ok"]
    assert step["ttft_ms"]["count"] == step["e2e_ms"]["count"] == len(ok)
    for r in ok:
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    # EOS is ignored: every successful request generated exactly what it asked for
    assert [r["generated_tokens"] for r in ok] == [r["max_new_tokens"] for r in ok]
    assert step["tokens"]["generated"] == step["tokens"]["requested"] == sum(r["max_new_tokens"] for r in ok)
    assert step["itl_ms"]["count"] == sum(r["chunks"] - 1 for r in ok)
    tput = step["throughput"]
    assert tput["output_tokens_per_s"] == pytest.approx(step["tokens"]["generated"] / step["duration_s"])
    assert tput["requests_per_s"] == pytest.approx(len(ok) / step["duration_s"])


def test_loadtest_chat_profile_closed_loop_tgi(server, tiny_model_dir, tmp_path):
    r = loadtest(tmp_path, "--url", server.url, "--api", "tgi", "--profile", "chat", "--users", "2",
                 "--requests", "6", "--max-prompt-tokens", "48", "--max-output-tokens", "12",
                 "--tokenizer", tiny_model_dir)
    assert r["tool"] == "gaudi-serve loadtest" and r["api"] == "tgi" and r["model"] == tiny_model_dir
    assert (r["prompt_tokens"], r["output_tokens"], r["max_output_tokens"]) == ("chat-prompt", "chat-output", 12)
    [step] = r["steps"]
    assert step["mode"] == "closed" and step["users"] == 2 and step["rate"] is None
    assert step["requests"] == {"sent": 6, "ok": 6, "errors": {}, "failed": 0}
    check_step(step)
    assert step["tokens"]["prompt_counted_by"] == "tokenizer"
    assert all(1 <= x["max_new_tokens"] <= 12 and x["prompt_tokens"] <= 49 for x in step["records"])
    # TGI streams one event per token
    assert all(x["chunks"] == x["generated_tokens"] for x in step["records"])


def test_loadtest_open_loop_openai_counts_400_for_prompts_over_the_limit(server, tiny_model_dir, tmp_path):
    r = loadtest(tmp_path, "--url", server.url, "--api", "openai", "--profile", "constant", "--rate", "20",
                 "--requests", "8", "--prompt-tokens", "choice:8,100", "--output-tokens", "6",
                 "--tokenizer", tiny_model_dir, "--ignore-eos", "--seed", "1")
    assert r["model"] == tiny_model_dir and r["ignore_eos"] is True
    [step] = r["steps"]
    assert step["mode"] == "open" and step["rate"] == 20
    check_step(step)
    too_long = [x for x in step["records"] if x["prompt_tokens"] > MAX_INPUT]
    assert too_long, "the seed should draw some 100-token prompts"
    assert step["requests"]["errors"] == {"400": len(too_long)}  # OpenAI's status for a prompt too long
    assert all(x["status"] == "400" and "maximum context length is 64" in x["error"] for x in too_long)
    ok = [x for x in step["records"] if x["status"] == "ok"]
    assert len(ok) == 8 - len(too_long) and all(x["generated_tokens"] == 6 for x in ok)
    assert step["tokens"]["prompt_counted_by"] == "server"  # usage from stream_options.include_usage


def test_loadtest_openai_chat_completions(server, tmp_path):
    r = loadtest(tmp_path, "--url", server.url, "--api", "openai-chat", "--profile", "chat", "--users", "2",
                 "--requests", "4", "--max-prompt-tokens", "32", "--max-output-tokens", "8", "--ignore-eos")
    [step] = r["steps"]
    assert step["requests"]["ok"] == 4
    check_step(step)
    # the chat template wraps the message: the server's count (usage) is what is reported
    assert step["tokens"]["prompt_counted_by"] == "server"
    assert all(x["chunks"] <= x["generated_tokens"] for x in step["records"])


def test_loadtest_multiturn_conversations_report_ttft_by_turn_and_the_hit_rate(server, tiny_model_dir, tmp_path):
    # Two turns: the tiny tokenizer spells the "User:" / "Assistant:" framing out in letters.
    r = loadtest(tmp_path, "--url", server.url, "--api", "tgi", "--profile", "multiturn", "--users", "2",
                 "--requests", "6", "--turns", "2", "--system-tokens", "8", "--prompt-tokens", "2",
                 "--output-tokens", "2", "--tokenizer", tiny_model_dir)
    assert (r["profile"], r["turns"], r["system_tokens"]) == ("multiturn", 2, 8)
    [step] = r["steps"]
    assert step["requests"] == {"sent": 6, "ok": 6, "errors": {}, "failed": 0}
    check_step(step)
    first, second = (step["ttft_by_turn"][t]["count"] for t in ("1", "2"))
    assert first + second == 6 and first >= second >= 2
    # Each second turn resends the first and its answer: longer prompts, partly found cached.
    longest = {t: max(x["prompt_tokens"] for x in step["records"] if x["turn"] == t) for t in (1, 2)}
    assert longest[2] > longest[1] > 8
    cache = step["prefix_cache"]
    assert cache["queries"] >= step["tokens"]["prompt"] and 0 < cache["hits"] < cache["queries"]


def test_loadtest_sweep_finds_saturation_then_plots_rates(server, tiny_model_dir, tmp_path):
    png = tmp_path / "sweep.png"
    # no --tokenizer: the server's /info names its model directory, whose tokenizer counts the prompts
    r = loadtest(tmp_path, "--url", server.url, "--profile", "sweep", "--users", "4", "--sweep-steps", "2",
                 "--requests", "4", "--prompt-tokens", "uniform:4:32", "--output-tokens", "8", "--plot", str(png))
    sat, *rates = r["steps"]
    assert sat["label"] == "saturation" and sat["mode"] == "closed" and sat["users"] == 4
    assert [s["mode"] for s in rates] == ["open", "open"]
    top = sat["throughput"]["requests_per_s"]
    assert [s["rate"] for s in rates] == pytest.approx([top / 2, top])
    for s in r["steps"]:
        assert s["requests"]["ok"] == 4
        assert s["tokens"]["prompt_counted_by"] == "tokenizer"
        assert all(2 <= x["prompt_tokens"] <= 33 for x in s["records"])
        check_step(s)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_mixed_workload_reports_chat_gaps_and_long_prompt_ttft(server, tiny_model_dir, capsys):
    """Chat streams keep streaming while long prompts arrive: the gaps, the chat rate and the long
    prompts' TTFT all come from tokens that arrived inside the window."""
    mixed.main(["--url", server.url, "--model", tiny_model_dir, "--tokenizer", tiny_model_dir,
                "--chat-streams", "2", "--chat-prompt", "8", "--chat-output", "16", "--long-prompt", "16",
                "--long-output", "4", "--long-every", "0.5", "--duration", "4", "--warmup", "0.5"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    r = {k: float(v) for k, v in (f.split("=") for f in line.split()[1:])}
    assert r["long_requests"] >= 2 and r["long_ttft_p50_ms"] > 0
    assert 0 <= r["chat_gap_p50_ms"] <= r["chat_gap_p99_ms"] <= r["chat_gap_max_ms"] and r["chat_gap_max_ms"] > 0
    assert r["chat_tokens_per_s"] > 0


def test_returning_conversations_build_then_return_as_after_a_restart(server, tiny_model_dir, tmp_path, capsys):
    """bench/kv_offload.sh's workload, small: the continuous run (first turns, then a returning round) and the
    same conversations split into `build` and `return` send the same turns and get the same greedy answers."""
    from gaudi_runtime.bench import kv_offload_report, returning

    common = ["--url", server.url, "--tokenizer", tiny_model_dir, "--conversations", "3", "--context-tokens", "4",
              "--message-tokens", "1", "--output-tokens", "2", "--concurrency", "1", "--seed", "5"]
    assert returning.main([*common, "--turns", "2", "--json", str(tmp_path / "all.json"),
                           "--outputs", str(tmp_path / "all.jsonl")]) == 0
    assert "RESULT phase=all conversations=3 requests=6 ok=6 " in capsys.readouterr().out
    everything = json.loads((tmp_path / "all.json").read_text())
    info = json.loads(urllib.request.urlopen(server.url + "/info", timeout=5).read())
    assert everything["device_budget"] == info["max_batch_total_tokens"]  # read from /info
    assert (everything["first_ttft_ms"]["count"], everything["returning_ttft_ms"]["count"]) == (3, 3)
    back = [t for t in everything["turns"] if t["round"] == 1]
    assert [t["conversation"] for t in back] == returning.return_order(3, 1, seed=5) and {t["turn"] for t in back} == {1}
    assert all(t["generated_tokens"] == 2 and t["ttft_ms"] > 0 for t in everything["turns"])
    assert everything["prefix_cache"]["returning"]["hits"] > 0  # a device this size still holds three contexts

    state = str(tmp_path / "state.json")
    assert returning.main([*common, "--turns", "1", "--phase", "build", "--state", state,
                           "--outputs", str(tmp_path / "build.jsonl")]) == 0
    assert returning.main([*common, "--phase", "return", "--state", state, "--json", str(tmp_path / "return.json"),
                           "--outputs", str(tmp_path / "return.jsonl")]) == 0
    again = json.loads((tmp_path / "return.json").read_text())
    assert (again["phase"], again["requests"], again["ok"], again["returning_ttft_ms"]["count"]) == ("return", 3, 3, 3)
    assert [t["turn"] for t in again["turns"]] == [1, 1, 1]
    split = {**kv_offload_report.load_outputs(tmp_path / "build.jsonl"),
             **kv_offload_report.load_outputs(tmp_path / "return.jsonl")}
    assert kv_offload_report.compare_outputs(kv_offload_report.load_outputs(tmp_path / "all.jsonl"), split)[0]


def test_loadtest_counts_connection_errors(tmp_path):
    from tests.runtime.launched import free_port

    r = loadtest(tmp_path, "--url", f"http://127.0.0.1:{free_port()}", "--profile", "constant", "--users", "1",
                 "--requests", "2", "--prompt-tokens", "4", "--output-tokens", "2", "--model", "x")
    [step] = r["steps"]
    assert step["requests"] == {"sent": 2, "ok": 0, "errors": {"connection": 2}, "failed": 2}


def check_benchmark(r: dict, batch_sizes: list[int], seq: int, decode: int, runs: int) -> None:
    assert r["tool"] == "gaudi-serve benchmark" and r["device"] == "cpu" and r["dtype"] == "float32"
    assert (r["sequence_length"], r["decode_length"], r["runs"]) == (seq, decode, runs)
    assert r["unwarmed_shapes"] == 0
    assert [x["batch_size"] for x in r["results"]] == batch_sizes
    for x in r["results"]:
        b = x["batch_size"]
        assert x["runs"] == runs
        # one token per request from the prefill and from each decode step
        assert x["generated_tokens"] == [b * (decode + 1)] * runs
        stats = [x["prefill"]["latency_ms"], x["prefill"]["throughput_tokens_per_s"],
                 x["decode"]["token_latency_ms"], x["decode"]["latency_ms"],
                 x["decode"]["throughput_tokens_per_s"], x["total_latency_ms"]]
        for s in stats:
            assert s["count"] == runs
            assert_ordered(s)
        d = x["decode"]
        # decode throughput = batch / token latency, run by run: the extremes pair up
        assert d["throughput_tokens_per_s"]["max"] == pytest.approx(b * 1000 / d["token_latency_ms"]["min"])
        assert d["throughput_tokens_per_s"]["min"] == pytest.approx(b * 1000 / d["token_latency_ms"]["max"])
        assert d["latency_ms"]["mean"] == pytest.approx(d["token_latency_ms"]["mean"] * decode)
        p = x["prefill"]
        assert p["throughput_tokens_per_s"]["max"] == pytest.approx(b * 1000 / p["latency_ms"]["min"])
        assert x["total_latency_ms"]["mean"] == pytest.approx(p["latency_ms"]["mean"] + d["latency_ms"]["mean"])


def test_benchmark_cli_spawns_shards_and_reports_per_batch_size(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi_runtime.cli", "benchmark", "--model-id", tiny_model_dir, "--dtype", "float32",
         "--batch-size", "1", "--batch-size", "3", "--sequence-length", "10", "--decode-length", "4",
         "--runs", "3", "--warmups", "1", "--shard-uds-path", str(tmp_path / "sock"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PAD_SEQUENCE_TO_MULTIPLE_OF="16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    check_benchmark(r, [1, 3], 10, 4, 3)
    assert "8/8" in proc.stderr  # the progress bar: 2 batch sizes x (3 runs + 1 warmup)
    for b in (1, 3):
        assert f"Batch size {b}\n| Step" in proc.stdout
    assert proc.stdout.count("| Decode (token) | Latency (ms)") == 2


def test_benchmark_attaches_to_shards_started_by_the_test(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from gaudi_runtime import launcher
    from gaudi_runtime.config import resolve

    monkeypatch.setenv("PAD_SEQUENCE_TO_MULTIPLE_OF", "16")
    monkeypatch.setenv("LOG_LEVEL", "warning")
    cfg = resolve(None, {"MODEL_ID": tiny_model_dir, "DTYPE": "float32", "SHARD_UDS_PATH": str(tmp_path / "s"),
                         "MAX_INPUT_TOKENS": "16", "MAX_TOTAL_TOKENS": "32", "MAX_BATCH_SIZE": "4",
                         "PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "LOG_LEVEL": "warning"})
    procs = launcher.spawn_shards(cfg, tiny_model_dir)
    try:
        out = tmp_path / "attach.json"
        code = cli.main(["benchmark", "--model-id", tiny_model_dir, "--dtype", "float32",
                         "--shard-uds-path", str(tmp_path / "s"), "--max-input-tokens", "16",
                         "--max-total-tokens", "32", "--max-batch-size", "4", "--attach",
                         "--batch-size", "2", "--batch-size", "4", "--sequence-length", "12", "--decode-length", "3",
                         "--runs", "2", "--warmups", "0", "--no-progress", "--json", str(out)])
        assert code == 0
        check_benchmark(json.loads(out.read_text()), [2, 4], 12, 3, 2)
        assert all(p.poll() is None for _, p in procs), "attach mode leaves the shards running"
        assert "Batch size 4" in capsys.readouterr().out
        # these shards hold 4 x ceil(32 / 16) = 8 KV blocks: 16 requests of one block each do not fit
        code = cli.main(["benchmark", "--model-id", tiny_model_dir, "--shard-uds-path", str(tmp_path / "s"),
                         "--attach", "--skip-warmup", "--batch-size", "16", "--sequence-length", "12",
                         "--decode-length", "3", "--runs", "1", "--warmups", "0", "--no-progress"])
        assert code == 1
        assert "batch size 16 needs 16 KV blocks, the shards hold 8" in capsys.readouterr().err
    finally:
        launcher.stop_all(procs)


def test_benchmark_refuses_a_batch_the_settings_cannot_hold(tiny_model_dir, tmp_path, capsys):
    code = cli.main(["benchmark", "--model-id", tiny_model_dir, "--batch-size", "8", "--max-batch-size", "4",
                     "--shard-uds-path", str(tmp_path / "s")])
    assert code == 2
    assert "--batch-size 8 exceeds --max-batch-size 4" in capsys.readouterr().err


def test_stream_path_reports_router_cpu_per_token_for_each_api(tiny_model_dir, capsys):
    from gaudi_runtime.bench import stream_path

    stream_path.main(["--model-id", tiny_model_dir, "--users", "2", "--requests", "3", "--tokens", "5",
                      "--per-call", "1", "3"])
    out = json.loads(capsys.readouterr().out)
    costs = {k: v for k, v in out.items() if k not in ("unit", "load")}
    assert set(costs) == {"tgi per_call=1", "tgi per_call=3", "openai per_call=1", "openai per_call=3", "detokenizer"}
    assert all(v >= 0 for v in costs.values())


def test_context_prefill_benchmark_prints_each_kernel_and_the_whole_prompt(tiny_model_dir):
    """`python -m gaudi_runtime.bench.context_prefill` (docs/performance.md), on a tiny problem."""
    out = subprocess.run([sys.executable, "-m", "gaudi_runtime.bench.context_prefill", "--model-id", tiny_model_dir,
                          "--new", "5", "--cached", "32", "--batch", "2", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [tuple(r[:4]) for r in rows] == [("2", "5", "32", name) for name in ("matmuls", "sdpa", "whole", "whole-flash")]
    assert all(float(r[4]) > 0 for r in rows)


def test_the_lora_workload_sends_each_request_its_adapter(tiny_model_dir, tmp_path, capsys):
    """bench/compare_vllm.sh's `lora` workload, small: the generated PEFT adapters pass the start-up checks
    (and are kept when asked again), and `bench.online --models` spreads its requests over them in turn."""
    import re
    import urllib.request

    from gaudi_runtime.bench import lora_adapters, online

    dirs = lora_adapters.write_adapters(tiny_model_dir, tmp_path / "adapters", count=2, rank=4)
    mtimes = [(d / "adapter_model.safetensors").stat().st_mtime_ns for d in dirs]
    assert lora_adapters.write_adapters(tiny_model_dir, tmp_path / "adapters", count=2, rank=4) == dirs
    assert [(d / "adapter_model.safetensors").stat().st_mtime_ns for d in dirs] == mtimes
    srv = launch(tiny_model_dir, tmp_path, "--dtype", "float32", "--max-input-tokens", str(MAX_INPUT),
                 "--max-total-tokens", "128", "--max-batch-size", "8", "--max-lora-rank", "4",
                 "--lora-modules", *(f"a{i}={d}" for i, d in enumerate(dirs, 1)))
    try:
        srv.wait_ready()
        online.main(["--url", srv.url, "--model-dir", str(tiny_model_dir), "--requests", "6", "--concurrency", "3",
                     "--input-len", "8", "--output-len", "4", "--models", "a1,a2"])
        result = capsys.readouterr().out
        with urllib.request.urlopen(srv.url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        srv.stop()
    assert re.search(r"^RESULT requests=6 concurrency=3 tokens=24 .* ttft_p50_ms=\S+ itl_p50_ms=\S+$", result, re.M)
    counts = {a: float(n) for a, n in re.findall(r'^gaudi_serve_lora_requests_total{adapter="(\w+)"} (\S+)$',
                                                 metrics, re.M)}
    assert counts == {"a1": 4.0, "a2": 4.0}  # three each, and each warmed by one request first


def test_lora_step_times_the_kernel_on_each_kind_of_lora_layer(tiny_model_dir, tmp_path, capsys):
    """`bench.lora_step --layers`: the LoRA kernel alone on q/k/v, o, gate/up and down, at decode and prefill,
    and the sum over the model's layers."""
    from gaudi_runtime.bench import lora_adapters, lora_step

    dirs = lora_adapters.write_adapters(tiny_model_dir, tmp_path / "adapters", count=2, rank=4)
    lora_step.main(["--model-id", tiny_model_dir, "--adapters", *map(str, dirs), "--max-lora-rank", "4",
                    "--batch", "4", "--prefill", "2", "8", "--repeats", "1", "--layers"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "model"]
    assert all(float(v) > 0 for r in rows for v in r[-2:])


def test_moe_layer_benchmark_prints_both_paths_for_each_token_count(capsys):
    from gaudi_runtime.bench import moe_layer

    moe_layer.main(["--tokens", "2", "40", "--experts", "8", "--top-k", "2", "--hidden", "32", "--inter", "48",
                    "--layers", "2", "--repeats", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["2", "40"]
    assert all(float(v) > 0 for r in rows for v in r[1:])


def test_few_rows_benchmark_prints_both_engines_and_the_layers_choice(capsys):
    from gaudi_runtime.bench import few_rows
    from gaudi_runtime.device import cpu_gemm, cpu_gemv

    if not cpu_gemm.supported():  # as test_cpu_gemm.py: oneDNN here has no bf16 product to compare with
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    few_rows.main(["--shapes", "64x512", "32x4096", "--rows", "1", "3", "--repeats", "1", "--cache-mb", "1",
                   "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["64x512 rows=1", "64x512 rows=3", "32x4096 rows=1",
                                                       "32x4096 rows=3"]
    takes = [line.rsplit(": ", 1)[1] for line in lines]
    assert takes == ["True", "True", "True", str(not cpu_gemv.kernel().bf16_dot)]
