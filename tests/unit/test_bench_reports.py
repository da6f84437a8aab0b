"""The pure parts of the two tools: stream accounting, step and run summaries, config checks, rendering."""

from __future__ import annotations

import argparse

import pytest

from gaudi_runtime.bench import benchmark, loadtest
from gaudi_runtime.bench.loadtest import Record, on_event, request_body, summarize_step, sweep_rates
from gaudi_runtime.bench.profiles import ConversationMaker, PromptMaker, parse_length
from gaudi_runtime.config import ConfigError, resolve


def test_tgi_events_count_tokens_and_take_details_from_the_last():
    rec = Record(index=0, start_s=0)
    for i in range(3):
        assert on_event("tgi", {"index": i, "token": {"id": 5, "text": "a"}, "details": None}, rec)
    assert on_event("tgi", {"index": 4, "token": {"id": 5}, "details": {"generated_tokens": 4,
                                                                      "finish_reason": "length"}}, rec)
    assert rec.generated_tokens == 4 and rec.finish_reason == "length"
    assert not on_event("tgi", {"error": "boom", "error_type": "generation"}, rec)
    assert rec.status == "stream_error"


def test_openai_events_prefer_the_servers_usage():
    rec = Record(index=0, start_s=0, prompt_tokens=10, prompt_counted_by="estimate")
    for _ in range(3):
        assert on_event("openai", {"choices": [{"text": "x", "finish_reason": None}]}, rec)
    assert on_event("openai", {"choices": [{"text": "", "finish_reason": "length"}]}, rec)
    assert rec.generated_tokens == 4 and rec.finish_reason == "length"
    assert not on_event("openai", {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}}, rec)
    assert (rec.generated_tokens, rec.prompt_tokens, rec.prompt_counted_by) == (5, 12, "server")


def test_openai_chat_events_count_only_chunks_with_text():
    rec = Record(index=0, start_s=0)
    assert not on_event("openai-chat", {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, rec)
    assert on_event("openai-chat", {"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]}, rec)
    assert on_event("openai-chat", {"choices": [{"delta": {"content": " there"}}]}, rec)
    assert not on_event("openai-chat", {"choices": [{"delta": {}, "finish_reason": "length"}]}, rec)
    assert rec.generated_tokens == 2 and rec.finish_reason == "length"
    on_event("openai-chat", {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3}}, rec)
    assert rec.generated_tokens == 3 and rec.prompt_tokens == 20


def test_request_bodies_ignore_eos_only_when_asked():
    p = loadtest.Planned(0, "hi", 2, "estimate", 7)
    path, body = request_body("tgi", p, "m", ignore_eos=True)
    assert path == "/generate_stream" and body["parameters"]["max_new_tokens"] == 7
    assert "ignore_eos" not in body and "ignore_eos" not in body["parameters"]
    path, body = request_body("openai", p, "m", ignore_eos=False)
    assert path == "/v1/completions" and body["max_tokens"] == 7 and "ignore_eos" not in body
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert request_body("openai", p, "m", ignore_eos=True)[1]["ignore_eos"] is True
    path, body = request_body("openai-chat", p, "m", ignore_eos=False)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert "prompt" not in body and "ignore_eos" not in body and body["max_tokens"] == 7


def rec(i, status="ok", ttft=10.0, e2e=100.0, gen=10, want=10, prompt=5, itl=(10.0,) * 9):
    return Record(index=i, start_s=0, status=status, prompt_tokens=prompt, prompt_counted_by="tokenizer",
                  max_new_tokens=want, generated_tokens=gen if status == "ok" else 0, chunks=gen,
                  ttft_ms=ttft if status == "ok" else None, e2e_ms=e2e if status == "ok" else None,
                  itl_ms=list(itl) if status == "ok" else [])


def test_step_summary_counts_errors_by_status_and_tokens_of_successes():
    records = [rec(0), rec(1, ttft=30, e2e=120), rec(2, "422"), rec(3, "422"), rec(4, "timeout")]
    s = summarize_step(records, elapsed=2.0, users=2)
    assert s["mode"] == "closed" and s["users"] == 2
    assert s["requests"] == {"sent": 5, "ok": 2, "failed": 3, "errors": {"422": 2, "timeout": 1}}
    assert s["tokens"]["generated"] == 20 == s["tokens"]["requested"]
    assert s["throughput"]["output_tokens_per_s"] == 10 and s["throughput"]["requests_per_s"] == 1
    assert s["ttft_ms"]["min"] == 10 and s["ttft_ms"]["max"] == 30
    assert s["tpot_ms"]["mean"] == pytest.approx(10)  # (100 - 10) / 9 and (120 - 30) / 9
    assert s["itl_ms"]["count"] == 18
    assert [r["status"] for r in s["records"]] == ["ok", "ok", "422", "422", "timeout"]


def test_sweep_rates_are_fractions_of_saturation():
    assert sweep_rates(6.0, 3) == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        sweep_rates(0.0, 3)


def test_loadtest_render_shows_every_step_and_errors():
    s1 = summarize_step([rec(0), rec(1, "422")], 1.0, rate=2.0)
    s1["label"] = "rate 2.00/s"
    s2 = summarize_step([rec(0), rec(1)], 1.0, rate=4.0)
    s2["label"] = "rate 4.00/s"
    report = {"api": "tgi", "url": "http://x", "model": "m", "profile": "sweep", "prompt_tokens": "8",
              "output_tokens": "10", "steps": [s1, s2]}
    text = loadtest.render(report)
    assert "rate 2.00/s: 1/2 ok, errors: 422: 1" in text and "Summary" in text and "TTFT (ms)" in text


def test_loadtest_plans_are_deterministic_per_index():
    w = loadtest.Workload(parse_length("uniform:5:50"), parse_length("chat-output", 64), PromptMaker(), seed=3)
    a, b = w.plan(17), w.plan(17)
    assert a == b and 1 <= a.max_new_tokens <= 64 and w.plan(18) != a


def test_bad_loadtest_arguments_exit_with_usage():
    with pytest.raises(SystemExit) as e:
        loadtest.main(["--url", "http://127.0.0.1:1", "--users", "2", "--rate", "3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        loadtest.main(["--url", "http://127.0.0.1:1", "--prompt-tokens", "zipf:1"])


def test_benchmark_summary_definitions():
    runs = [benchmark.RunTimes(prefill_s=0.010, decode_s=0.080, generated=4 * 9),
            benchmark.RunTimes(prefill_s=0.020, decode_s=0.040, generated=4 * 9)]
    r = benchmark.summarize_runs(4, 10, 8, runs)
    assert r["prefill"]["latency_ms"]["mean"] == pytest.approx(15)
    assert r["prefill"]["throughput_tokens_per_s"]["max"] == pytest.approx(400)  # 4 tokens in 10 ms
    assert r["prefill"]["prompt_tokens_per_s"]["max"] == pytest.approx(4000)
    assert r["decode"]["token_latency_ms"]["min"] == pytest.approx(5)  # 40 ms / 8 steps
    assert r["decode"]["throughput_tokens_per_s"]["max"] == pytest.approx(4 / 0.005)
    assert r["total_latency_ms"]["min"] == pytest.approx(60) and r["total_latency_ms"]["max"] == pytest.approx(90)


def args(**kw):
    base = dict(sequence_length=10, decode_length=8, batch_size=[1, 4], max_input_tokens=None,
                max_total_tokens=None, max_batch_size=None, max_batch_prefill_tokens=None, model_id="m")
    return argparse.Namespace(**{**base, **kw})


def test_benchmark_sizes_the_server_settings_it_needs():
    a = args()
    benchmark.derive_flags(a, environ={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    assert (a.max_input_tokens, a.max_total_tokens, a.max_batch_size, a.max_batch_prefill_tokens) == \
        ("10", "18", "4", "64")
    cfg = resolve(a, {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    benchmark.check_fits(cfg, [1, 4], 10, 8)
    kept = args(max_batch_size="2")
    benchmark.derive_flags(kept, environ={"MAX_TOTAL_TOKENS": "100"})
    assert kept.max_batch_size == "2" and kept.max_total_tokens is None  # the flag and the env win


@pytest.mark.parametrize("flags,msg", [
    ({"max_batch_size": "2"}, "--batch-size 4 exceeds --max-batch-size 2"),
    ({"max_total_tokens": "12"}, "exceeds --max-total-tokens 12"),
    ({"max_batch_prefill_tokens": "32"}, "exceeds --max-batch-prefill-tokens 32"),
])
def test_benchmark_refuses_batches_the_configuration_cannot_run(flags, msg):
    a = args(**flags)
    benchmark.derive_flags(a, environ={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    cfg = resolve(a, {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    with pytest.raises(ConfigError, match=msg):
        benchmark.check_fits(cfg, [1, 4], 10, 8)


def test_benchmark_render_has_a_table_per_batch_size():
    runs = [benchmark.RunTimes(0.01, 0.08, 9)]
    report = {"model_id": "m", "device": "cpu", "dtype": "float32", "num_shard": 1, "sequence_length": 10,
              "decode_length": 8, "runs": 1, "warmups": 0, "unwarmed_shapes": 0,
              "results": [benchmark.summarize_runs(b, 10, 8, runs) for b in (1, 2)]}
    text = benchmark.render(report)
    assert "Batch size 1" in text and "Batch size 2" in text
    assert text.count("| Decode (token) | Latency (ms)") == 2


def test_a_conversation_resends_its_history_each_turn():
    maker = ConversationMaker(PromptMaker(), 30, parse_length("50"), parse_length("7"), turns=3, seed=1)
    conv, again = maker.conversation(4), maker.conversation(4)
    assert conv == again and conv.system == maker.conversation(5).system  # one system prompt for all
    assert conv.user_messages != maker.conversation(5).user_messages and conv.max_new_tokens == [7, 7, 7]
    conv.answers = [" first answer", " second"]
    first, second, third = (conv.prompt(t) for t in range(3))
    assert first.startswith(conv.system) and second.startswith(first + " first answer")
    assert third.startswith(second + " second") and third.endswith(conv.user_messages[2] + "\n\nAssistant:")
    assert [m["role"] for m in conv.messages(2)] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert conv.messages(2)[4]["content"] == " second"
    workload = loadtest.ConversationWorkload(parse_length("5"), parse_length("7"), maker)
    p = workload.plan(conv, 1, index=9)
    assert (p.index, p.turn, p.prompt, p.max_new_tokens) == (9, 2, second, 7)
    path, body = request_body("openai-chat", p, "m", ignore_eos=False)
    assert body["messages"] == conv.messages(1)


def test_streamed_text_is_kept_for_the_next_turn():
    r = Record(index=0, start_s=0)
    on_event("tgi", {"token": {"id": 5, "text": "Hi", "special": False}}, r)
    on_event("tgi", {"token": {"id": 2, "text": "</s>", "special": True}}, r)
    on_event("tgi", {"token": {"id": 6, "text": " you"}}, r)
    assert r.text == "Hi you"
    chat = Record(index=0, start_s=0)
    on_event("openai-chat", {"choices": [{"delta": {"content": "a"}}]}, chat)
    on_event("openai-chat", {"choices": [{"delta": {"content": "b"}}]}, chat)
    assert chat.text == "ab" and "text" not in loadtest._record_json(chat)  # not in the JSON report


def test_prefix_cache_hit_rate_is_read_from_either_servers_metrics():
    ours = "# HELP x\ngaudi_serve_prefix_cache_queries_total 200.0\ngaudi_serve_prefix_cache_hits_total 150.0\n"
    vllm = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 90.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n')
    assert loadtest.parse_prefix_cache_counters(ours) == (200.0, 150.0)
    assert loadtest.parse_prefix_cache_counters(vllm) == (90.0, 30.0)
    assert loadtest.parse_prefix_cache_counters("tgi_queue_size 0\n") is None
    delta = loadtest.prefix_cache_delta((100.0, 50.0), (200.0, 150.0))
    assert delta == {"queries": 100.0, "hits": 100.0, "hit_rate": 1.0}
    assert loadtest.prefix_cache_delta(None, (1.0, 1.0)) is None


def test_multiturn_report_shows_ttft_by_turn_and_the_hit_rate():
    records = [rec(i, ttft=10.0 * (i % 2 + 1)) for i in range(4)]
    for i, r in enumerate(records):
        r.turn = i % 2 + 1
    step = summarize_step(records, 1.0, users=2)
    assert step["ttft_by_turn"]["1"]["p50"] == 10.0 and step["ttft_by_turn"]["2"]["p50"] == 20.0
    step.update(label="2 users", prefix_cache={"queries": 400.0, "hits": 300.0, "hit_rate": 0.75})
    report = {"api": "openai", "url": "http://x", "model": "m", "profile": "multiturn", "prompt_tokens": "100",
              "output_tokens": "64", "turns": 2, "system_tokens": 1000, "steps": [step]}
    text = loadtest.render(report)
    assert "75.0% of prompt tokens found cached (300 of 400)" in text
    assert "| Turn |" in text and "1000-token system prompt" in text
    with pytest.raises(SystemExit):
        loadtest.main(["--url", "http://127.0.0.1:1", "--profile", "multiturn", "--rate", "2"])


# ---- engine overhead: the host-time breakdown and the comparison table ----------------------------

ROUTER = 'process 1:"python gaudi-serve launch --model-id m";process 3:"python -m gaudi_runtime.cli router"'
SHARD = 'process 1:"python gaudi-serve launch --model-id m";process 2:"python -m gaudi_runtime.cli shard --rank 0"'
LOOP = "BaseEventLoop._run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
PROFILE = f"""\
{SHARD};{LOOP};ShardServicer.Decode (gaudi_runtime/shard/servicer.py:117);ModelRunner.decode (gaudi_runtime/shard/runner.py:394);StepFunctions.decode_step (gaudi_runtime/shard/steps.py:74);_packed_linear (gaudi_runtime/device/cpu_gemm.py:37) 30
{SHARD};{LOOP};ShardServicer.Decode (gaudi_runtime/shard/servicer.py:117);ModelRunner.decode (gaudi_runtime/shard/runner.py:218);sample (gaudi_runtime/shard/step_sampling.py:47) 10
{SHARD};{LOOP};ShardServicer.Decode (gaudi_runtime/shard/servicer.py:124);to_generations (gaudi_runtime/shard/servicer.py:40) 2
{SHARD};{LOOP} 6
{ROUTER};{LOOP};drive (gaudi_runtime/router/sse.py:64);send (gaudi_runtime/router/sse.py:29);_SelectorSocketTransport.write (asyncio/selector_events.py:1057) 8
{ROUTER};{LOOP};BatchingLoop._answer_decode (gaudi_runtime/router/batching.py:250);OutputProcessor.process (gaudi_runtime/router/output.py:40);IncrementalDetokenizer.add (gaudi_runtime/router/detokenizer.py:48);RouterTokenizer.decode (gaudi_runtime/router/tokenizer.py:141) 3
{ROUTER};{LOOP};Requests.add (gaudi_runtime/router/live_requests.py:50);RouterTokenizer.encode (gaudi_runtime/router/tokenizer.py:122);TokenizersBackend._encode_plus (transformers/tokenization_utils_tokenizers.py:9) 1
{ROUTER};Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982) 1
not a stack line
"""


def test_host_profile_sorts_each_process_stacks_into_the_engines_parts():
    from gaudi_runtime.bench.host_profile import breakdown, parse_raw

    rows = {(r.role, r.category): r.samples for r in breakdown(parse_raw(PROFILE))}
    assert rows == {
        ("shard", "forward pass (decode)"): 30, ("shard", "sampling"): 10, ("shard", "gRPC + messages"): 2,
        ("shard", "event loop: C callbacks (gRPC completions, protobuf, wake-ups)"): 6,
        ("router", "SSE writes"): 8, ("router", "detokenization"): 3, ("router", "tokenization + validation"): 1,
        ("router", "gRPC poller thread (C)"): 1,
    }
    roles = [r.role for r in breakdown(parse_raw(PROFILE))]
    assert roles == sorted(roles, key=["router", "shard"].index)  # the router's rows first, largest first


def test_host_profile_table_gives_cost_per_token_and_per_decode_call():
    from gaudi_runtime.bench.host_profile import breakdown, load_counts, parse_raw, render

    before = ('# TYPE tgi_request_generated_tokens histogram\ntgi_request_generated_tokens_sum 1000.0\n'
              '# TYPE tgi_batch_inference_count counter\ntgi_batch_inference_count{method="decode"} 10.0\n'
              'tgi_batch_inference_count{method="prefill"} 3.0\n'
              '# TYPE tgi_batch_forward_duration histogram\ntgi_batch_forward_duration_sum{method="decode"} 1.0\n')
    after = before.replace("1000.0", "3000.0").replace('"decode"} 10.0', '"decode"} 30.0').replace(
        '"decode"} 1.0', '"decode"} 1.5')
    counts = load_counts(before, after)
    assert counts == {"tokens": 2000.0, "decode_calls": 20.0, "forward_s": 0.5}
    table = render(breakdown(parse_raw(PROFILE)), rate_hz=100, counts=counts)
    # 30 samples at 100 Hz: 0.3 s, over 2,000 tokens 150 µs each, over 20 calls 15 ms each.
    assert "| shard | forward pass (decode) | 0.30 | 62.5% | 150 | 15.00 |" in table
    assert "| shard | **all** | 0.48 | 100% | 240 | 24.00 |" in table
    assert "2000 output tokens, 20 decode calls" in table
    assert "| n/a | n/a |" in render(breakdown(parse_raw(PROFILE)), rate_hz=100)  # no metrics: no denominators


def loadtest_report(tok_s, ttft_p50, ok=192, sent=192):
    return {"steps": [{"throughput": {"output_tokens_per_s": tok_s}, "ttft_ms": {"p50": ttft_p50},
                       "requests": {"ok": ok, "sent": sent}}]}


def test_overhead_table_gives_each_engine_its_ratios_to_vllm_at_the_same_concurrency(tmp_path):
    import json

    from gaudi_runtime.bench import overhead_report

    for name, report in {"vllm-c48": loadtest_report(1000, 200), "ours-c48": loadtest_report(1600, 150),
                         "ours-omp1-c48": loadtest_report(500, 400, ok=190), "vllm-c64": loadtest_report(2000, 100),
                         "ours-c64": loadtest_report(1000, 50)}.items():
        (tmp_path / f"overhead-{name}.json").write_text(json.dumps(report))
    (tmp_path / "multiturn-vllm.json").write_text("{}")  # another workload's report is left alone
    lines = overhead_report.table(overhead_report.load(tmp_path), run=2)
    rows = {" ".join(line.split()[1:3]): line.split()[3:] for line in lines[1:]}
    assert list(rows)[0] == "vllm c48" and list(rows)[3] == "vllm c64"  # the reference first at each concurrency
    assert rows["vllm c48"] == ["1000.0", "200.0", "192/192"]
    assert rows["ours c48"] == ["1600.0", "150.0", "192/192", "1.60", "0.75", "met"]
    assert rows["ours-omp1 c48"] == ["500.0", "400.0", "190/192", "0.50", "2.00", "MISSED"]
    assert rows["ours c64"][3:] == ["0.50", "0.50", "MISSED"]
    assert overhead_report.table({}) == []


# ---- KV cache tiers: returning conversations and bench/kv_offload.sh's table -----------------------

def test_returning_conversations_outgrow_the_device_budget_and_keep_their_own_prefix():
    from gaudi_runtime.bench.returning import Shape, conversations_needed, make_conversations

    shape = Shape(context_tokens=100, message_tokens=10, output_tokens=5, turns=3)
    assert shape.history(1) == 115 and shape.history(3) == 145
    n = conversations_needed(1000, shape)
    assert n == 35 and n * shape.history(1) >= 4 * 1000 > (n - 1) * shape.history(1)
    assert conversations_needed(1000, shape, multiple=8) == 70
    convs = make_conversations(PromptMaker(), 3, shape, seed=2)
    assert convs == make_conversations(PromptMaker(), 3, shape, seed=2) != make_conversations(PromptMaker(), 3, shape, 3)
    # one message more than the turns (what --phase return sends), every answer asked for the same length
    assert all(len(c.user_messages) == 4 and c.max_new_tokens == [5] * 4 and not c.answers for c in convs)
    # no two conversations share an opening: a returning prefix can only come from its own history
    assert [c.system.split(".")[0] for c in convs] == ["Conversation 0", "Conversation 1", "Conversation 2"]


def test_conversations_return_in_a_seeded_random_order_after_all_first_turns():
    from gaudi_runtime.bench.returning import return_order

    assert return_order(6, 0, seed=1) == list(range(6))  # the first turns, in order
    rounds = [return_order(50, r, seed=1) for r in (1, 2)]
    assert all(sorted(o) == list(range(50)) for o in rounds) and rounds[0] != rounds[1] != list(range(50))
    assert return_order(50, 1, seed=1) == rounds[0] != return_order(50, 1, seed=2)


def test_a_round_sends_each_conversation_its_next_turn_and_a_failure_ends_it():
    import asyncio

    from gaudi_runtime.bench.returning import Shape, make_conversations, run_round

    convs = make_conversations(PromptMaker(), 3, Shape(20, 5, 4, 2), seed=0)
    convs[1].answers = ["earlier"]
    sent = []

    async def fake_send(p):
        sent.append(p)
        ok = not p.prompt.startswith("Conversation 2")
        return Record(index=p.index, start_s=0, status="ok" if ok else "500", text=f" answer{len(sent)}",
                      ttft_ms=5.0 if ok else None, generated_tokens=p.max_new_tokens if ok else 0)

    turns = asyncio.run(run_round(convs, [2, 1, 0], round_=1, concurrency=1, send_one=fake_send))
    assert [(t.conversation, t.turn, t.round) for t in turns] == [(2, 0, 1), (1, 1, 1), (0, 0, 1)]
    assert sent[1].prompt == convs[1].prompt(1) and "Assistant:earlier" in sent[1].prompt
    assert all(p.max_new_tokens == 4 for p in sent)
    assert convs[1].answers == ["earlier", " answer2"] and convs[0].answers == [" answer3"] and convs[2].answers == []


def test_returning_summary_separates_first_and_returning_turns():
    from gaudi_runtime.bench.returning import Turn, summarize

    def turn(c, t, rnd, ttft, status="ok"):
        r = Record(index=0, start_s=0, status=status, ttft_ms=ttft, generated_tokens=10 if status == "ok" else 0,
                   prompt_tokens=100, text=f"c{c}t{t}")
        return Turn(c, t, rnd, r)

    turns = [turn(0, 0, 0, 100.0), turn(1, 0, 0, 300.0), turn(1, 1, 1, 20.0), turn(0, 1, 1, 40.0),
             turn(0, 2, 2, 60.0), turn(1, 2, 2, None, "timeout")]
    hits = {"queries": 100.0, "hits": 50.0, "hit_rate": 0.5}
    s = summarize(turns, {0: (2.0, None), 1: (1.0, hits), 2: (1.0, hits)}, elapsed=4.0, model="m")
    assert (s["requests"], s["ok"], s["errors"]) == (6, 5, {"timeout": 1})
    assert s["first_ttft_ms"]["p50"] == 200.0 and s["first_ttft_ms"]["count"] == 2
    assert s["returning_ttft_ms"]["p50"] == 40.0 and s["returning_ttft_ms"]["count"] == 3
    assert s["tokens_per_s"] == 50 / 4.0 and s["returning_tokens_per_s"] == 30 / 2.0
    assert s["prefix_cache"] == {"first": None, "returning": {"queries": 200.0, "hits": 100.0, "hit_rate": 0.5}}
    assert [t["text"] for t in s["turns"]][:2] == ["c0t0", "c1t0"]


def test_the_kv_tier_size_in_gib_comes_from_the_models_config():
    from gaudi_runtime.bench import kv_offload_report as kr

    small = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 8}
    assert kr.kv_bytes_per_token(small) == 2 * 8 * 4 * 64 * 2 == 8192
    assert kr.gib(8 * 4096, 8192) == 0.25
    assert kr.kv_bytes_per_token({**small, "head_dim": 32, "num_key_value_heads": None}, "float32") == 2 * 8 * 8 * 32 * 4


def test_tier_metric_lines_are_read_loosely_by_name():
    from gaudi_runtime.bench.kv_offload_report import tier_metric_lines

    text = ("# HELP gaudi_serve_kv_offload_hits_total x\ngaudi_serve_kv_offload_hits_total{tier=\"host\"} 3.0\n"
            "gaudi_serve_kv_tier_bytes{medium=\"disk\"} 10\ngaudi_serve_prefix_cache_hits_total{tier=\"x\"} 1\n"
            "tgi_queue_size 0\n")
    assert tier_metric_lines(text) == ['gaudi_serve_kv_offload_hits_total{tier="host"} 3.0',
                                       'gaudi_serve_kv_tier_bytes{medium="disk"} 10']
    assert tier_metric_lines("") == []


def test_greedy_outputs_are_compared_turn_by_turn(tmp_path):
    from gaudi_runtime.bench import kv_offload_report as kr

    r = {"turns": [{"conversation": 1, "turn": 0, "status": "ok", "text": "b"},
                   {"conversation": 0, "turn": 0, "status": "ok", "text": "a"},
                   {"conversation": 0, "turn": 1, "status": "timeout", "text": ""}]}
    kr.write_outputs(r, tmp_path / "a.jsonl")
    a = kr.load_outputs(tmp_path / "a.jsonl")
    assert a == {(0, 0): "a", (1, 0): "b"}
    assert kr.compare_outputs(a, dict(a)) == (True, "2 answers identical")
    same, detail = kr.compare_outputs(a, {(0, 0): "a", (1, 0): "c"})
    assert not same and detail.startswith("conversation 1 turn 1 differs")
    assert kr.compare_outputs(a, {(0, 0): "a"}) == (False, "conversation 1 turn 1 answered by one run only")
    assert kr.compare_outputs({}, {})[0] is False
    assert kr.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")]) == 0


def _run_report(ttft_back: float, tok_s: float) -> dict:
    return {"ok": 4, "requests": 4, "tokens_per_s": tok_s, "first_ttft_ms": {"p50": 100.0},
            "returning_ttft_ms": {"p50": ttft_back, "p90": ttft_back * 2},
            "prefix_cache": {"returning": {"hit_rate": 0.9}}}


def test_the_kv_offload_table_gives_each_target_met_or_missed_and_says_what_was_skipped():
    from gaudi_runtime.bench import kv_offload_report as kr

    reports = {"none": _run_report(100.0, 10.0),
               "host": {**_run_report(25.0, 14.0), "tier_metrics": ['kv_offload_hits_total{tier="host"} 7']},
               "disk-return": _run_report(50.0, 10.0), "cold-return": _run_report(100.0, 10.0)}
    outputs = {"none": {(0, 0): "a"}, "host": {(0, 0): "a"}, "disk-return": {(0, 1): "x"},
               "cold-return": {(0, 1): "y"}}
    text = kr.summary_table(reports, outputs, {"vllm": "vLLM's CPU build does not offload: boom"})
    assert "returning TTFT p50, host tier / none: 0.25 (target <= 0.3) met" in text
    assert "throughput, host tier / none: 1.40 (target >= 1.3) met" in text
    assert "first returning TTFT p50 after restart, disk / cold: 0.50 (target <= 0.4) MISSED" in text
    assert "ours host tier / vLLM offloading: not measured (vllm skipped)" in text
    assert "vllm skipped: vLLM's CPU build does not offload: boom" in text
    assert 'host metric: kv_offload_hits_total{tier="host"} 7' in text
    assert "greedy outputs identical, host vs none: yes" in text
    assert "greedy outputs identical, disk-return vs cold-return: NO (conversation 0 turn 2 differs" in text
    assert "| disk-build  | ours, disk tier: build        | not run |" in text
    assert "| host        | ours, host tier               |     4/4 |          100.0 |            25.0 |" in text


def test_the_kv_offload_table_reads_what_the_script_left(tmp_path, capsys):
    import json

    from gaudi_runtime.bench import kv_offload_report as kr

    (tmp_path / "none.json").write_text(json.dumps(_run_report(80.0, 10.0)))
    (tmp_path / "none.jsonl").write_text('{"conversation": 0, "turn": 0, "text": "a"}\n')
    (tmp_path / "skipped.txt").write_text("host the server did not start with the tier flags\n")
    assert kr.main(["table", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| none        | ours, no tier                 |     4/4 |" in out and "| host        | ours, host tier" \
        "               | skipped |" in out
    assert "host skipped: the server did not start with the tier flags" in out
    assert "greedy outputs identical, host vs none: not compared (host skipped)" in out


def test_bad_returning_arguments_exit_with_usage(capsys):
    from gaudi_runtime.bench import returning

    for argv, msg in ((["--phase", "return"], "--phase return needs --state"),
                      (["--turns", "0"], "must be positive"), (["--phase", "later"], "invalid choice"),
                      (["--phase", "return", "--state", "/nonexistent/s.json"], "no such file"),
                      (["--phase", "build", "--state", "/nonexistent/s.json"], "its directory does not exist")):
        with pytest.raises(SystemExit) as e:
            returning.main(["--url", "http://127.0.0.1:1", *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert returning.main(["--url", "http://127.0.0.1:1", "--conversations", "1"]) == 1  # nothing listens
    assert "error: http://127.0.0.1:1: " in capsys.readouterr().err
