"""KV-cache events as a prefix-cache-aware picker reads them, decoded with vLLM's own classes
(vllm.distributed.kv_events of the vLLM the benchmarks use; tests/runtime/vllm_events.py).

First the publisher alone: its bytes are vLLM's, its sequence numbers count up, its replay socket
answers as vLLM's does. Then a real runtime with a small KV cache: a two-turn conversation's
blocks are announced as stored, chained turn to turn, and other traffic's need for room evicts
them, which is announced too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from gaudi_runtime.router.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KvEvents,
    ZmqPublisher,
    removed,
    stored,
)
from gaudi_runtime.router.metrics import CACHE_CONFIG_INFO, LOAD_GAUGES
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import free_port, get_json, launch, shard_of
from tests.runtime.vllm_events import Subscriber

H = [bytes([i]) * 32 for i in range(4)]  # block hashes: 32 bytes, as vLLM's sha256 ones


def publish_until_heard(publisher: ZmqPublisher, sub: Subscriber, deadline_s: float = 30.0) -> int:
    """Publish probes until the subscriber hears one (a PUB socket drops what it sends before the
    subscription reaches it); returns how many were sent: the sequence number of the next batch."""
    sink = KvEvents(publisher)
    deadline = time.monotonic() + deadline_s
    sent = 0
    while not sub.received():
        assert time.monotonic() < deadline, "the subscriber never heard the publisher"
        sink.add(AllBlocksCleared())
        sent += 1
        time.sleep(0.05)  # poll interval of a deadline-bounded wait
    return sent


@pytest.fixture
def bound_publisher():
    """A publisher that binds (a wildcard endpoint, vLLM's default form) and a subscriber connected to it."""
    port, replay = free_port(), free_port()
    pub = ZmqPublisher(f"tcp://*:{port}", topic="kv", replay_endpoint=f"tcp://*:{replay}", buffer_steps=100)
    sub = Subscriber(topic="kv", connect=f"tcp://127.0.0.1:{port}")
    yield pub, sub, f"tcp://127.0.0.1:{replay}"
    pub.close()
    sub.close()


def test_batches_decode_with_vllms_classes_in_order(vllm_decoder, bound_publisher):
    pub, sub, _ = bound_publisher
    probes = publish_until_heard(pub, sub)
    sink = KvEvents(pub)
    sink.add(stored(H[:2], None, list(range(8)), 4))
    sink.add(stored(H[2:3], H[1], [8, 9, 10, 11], 4))
    sink.add(removed([H[0], H[2]]))
    sink.add(AllBlocksCleared())  # no loop runs here: each event is its own batch
    got = [m for m in sub.wait_for(probes + 3) if int.from_bytes(m[1], "big") >= probes]
    batches = vllm_decoder.decode(got)
    assert [b["topic"] for b in batches] == ["kv"] * len(got)
    assert [b["seq"] for b in batches] == [probes, probes + 1, probes + 2, probes + 3]  # one per batch, in order
    assert all(b["data_parallel_rank"] == 0 for b in batches)
    events = [b["events"][0] for b in batches]
    assert {e["module"] for e in events} == {"vllm.distributed.kv_events"}
    first, second, gone, cleared = events
    assert first["class"] == "BlockStored" and first["block_hashes"] == [H[0].hex(), H[1].hex()]
    assert first["parent_block_hash"] is None and first["token_ids"] == list(range(8))
    assert (first["block_size"], first["lora_id"], first["medium"], first["group_idx"]) == (4, None, "GPU", 0)
    assert second["parent_block_hash"] == H[1].hex() and second["token_ids"] == [8, 9, 10, 11]
    assert gone["class"] == "BlockRemoved" and gone["block_hashes"] == [H[0].hex(), H[2].hex()]
    assert gone["medium"] == "GPU"
    assert cleared["class"] == "AllBlocksCleared"


def test_replay_sends_the_buffered_batches_from_a_sequence_number(bound_publisher):
    pub, sub, replay = bound_publisher
    probes = publish_until_heard(pub, sub)
    sink = KvEvents(pub)
    for h in H:
        sink.add(removed([h]))
    live = sub.wait_for(probes + 3)
    # A DEALER, so that one request may get many replies; the empty frame is what a REQ would add.
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.connect(replay)
    try:
        client.send_multipart([b"", live[-2][1]])  # from the second last batch on
        replies = []
        while True:
            assert client.poll(10_000), "no replay answer"
            empty, *parts = client.recv_multipart()
            assert empty == b""
            if parts[1] == END_SEQ:
                break
            replies.append(parts)
    finally:
        client.close(linger=0)
    assert replies == live[-2:]


# ---- a real runtime ----------------------------------------------------------------------------

BLOCK = 4
MODEL = "tiny-llama"
WORDS = "the gaudi card shard router token batch cache serve request stream answer question node"
KV_BLOCKS = 64


ARGS = ["--dtype", "float32", "--max-input-tokens", "64", "--max-total-tokens", "96", "--max-batch-size", "2",
        "--block-size", str(BLOCK), "--max-batch-total-tokens", str(KV_BLOCKS * BLOCK), "--model-name", MODEL]
ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "2", "PREFILL_BATCH_BUCKET_SIZE": "2",
       "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two runtimes, started side by side: 64 KV blocks of 4 tokens, batches of 2. The first publishes
    KV events to a subscriber that binds (as a picker's does); both serve /metrics."""
    tmp = tmp_path_factory.mktemp("kv_events")
    model = make_tiny_model(tmp / "llama", "llama")
    sub = Subscriber(topic="kv")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "topic": "kv"}
    servers = [launch(model, tmp, *ARGS, "--kv-events-config", json.dumps(config), env=ENV),
               launch(model, tmp, *ARGS, env=ENV)]
    try:
        for srv in servers:
            srv.wait_ready()
        yield servers, sub
    finally:
        for srv in servers:
            srv.stop()
        sub.close()


def generate(url: str, prompt: str, max_new_tokens: int) -> str:
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["generated_text"]


def events_of(decoder, sub: Subscriber) -> list[dict]:
    return [e for b in decoder.decode(sub.received()) for e in b["events"]]


def token_ids(url: str, text: str) -> list[int]:
    """The prompt's tokens as the router computes them (TGI's /tokenize)."""
    body = json.dumps({"inputs": text}).encode()
    req = urllib.request.Request(url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [t["id"] for t in json.loads(r.read())]


def wait_for_events(decoder, sub: Subscriber, done, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not done(events := events_of(decoder, sub)):
        assert time.monotonic() < deadline, events[-5:]
        time.sleep(0.05)  # poll interval of a deadline-bounded wait
    return events


def test_a_conversation_is_announced_block_by_block_and_its_eviction_too(vllm_decoder, replicas):
    (srv, _), sub = replicas
    assert get_json(srv.url + "/info")[1]["kv_blocks"] == KV_BLOCKS
    events = events_of(vllm_decoder, sub)
    assert events[0]["class"] == "AllBlocksCleared"  # published once ready: the cache starts empty
    assert {e["module"] for e in events} == {"vllm.distributed.kv_events"}

    turn1 = f"{WORDS} {WORDS}"
    answer = generate(srv.url, turn1, 8)
    # Turn 1's prompt blocks when it is taken, then its answer's (every token generated but the
    # last was written) when it ends: a run whose parent is the prompt's last block.
    events = wait_for_events(vllm_decoder, sub, lambda ev: any(
        e["class"] == "BlockStored" and e["parent_block_hash"] is not None for e in ev[len(events):]))
    t1 = [e for e in events if e["class"] == "BlockStored"]
    prompt1 = token_ids(srv.url, turn1)
    full = len(prompt1) // BLOCK
    assert t1[0]["parent_block_hash"] is None and len(t1[0]["block_hashes"]) == full  # a sequence's start
    assert t1[0]["token_ids"] == prompt1[:full * BLOCK] and t1[0]["block_size"] == BLOCK
    assert t1[1]["parent_block_hash"] == t1[0]["block_hashes"][-1]
    assert t1[1]["token_ids"][:len(prompt1) - full * BLOCK] == prompt1[full * BLOCK:]
    turn1_blocks = [h for e in t1 for h in e["block_hashes"]]

    turn2 = f"{turn1}{answer} and then what about the cluster"
    before = len(events)
    generate(srv.url, turn2, 8)
    events = wait_for_events(vllm_decoder, sub, lambda ev: any(e["class"] == "BlockStored" for e in ev[before:]))
    t2 = [e for e in events[before:] if e["class"] == "BlockStored"]
    # Turn 2 reads turn 1's blocks and stores only what follows them, chained onto turn 1's last.
    assert t2[0]["parent_block_hash"] in turn1_blocks and not set(t2[0]["block_hashes"]) & set(turn1_blocks)
    prompt2 = token_ids(srv.url, turn2)
    shared = turn1_blocks.index(t2[0]["parent_block_hash"]) + 1
    assert t2[0]["token_ids"] == prompt2[shared * BLOCK:(shared + len(t2[0]["block_hashes"])) * BLOCK]
    conversation = set(turn1_blocks) | {h for e in t2 for h in e["block_hashes"]}

    # Other prompts need room: the conversation's blocks, cached but held by no request, are evicted.
    deadline = time.monotonic() + 120
    n = 0
    while not {h for e in events_of(vllm_decoder, sub) if e["class"] == "BlockRemoved"
               for h in e["block_hashes"]} & conversation:
        assert time.monotonic() < deadline, "no block of the conversation was evicted"
        generate(srv.url, " ".join(random.Random(n).choices(WORDS.split(), k=30)), 24)
        n += 1
    assert n > 1  # not before other traffic needed the room
    events = events_of(vllm_decoder, sub)
    stored_ever = {h for e in events if e["class"] == "BlockStored" for h in e["block_hashes"]}
    removed_ever = {h for e in events if e["class"] == "BlockRemoved" for h in e["block_hashes"]}
    assert removed_ever <= stored_ever  # only what was announced is ever removed


# ---- the picker's view of the load --------------------------------------------------------------

def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    """vLLM's gauges as a picker reads them: name -> [(labels, value)]."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict, float]]] = {name: [] for name in (*LOAD_GAUGES, CACHE_CONFIG_INFO)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name].append((s.labels, s.value))
    return out


def load(scraped: dict) -> tuple[float, ...]:
    """(waiting, running, KV usage) of the one model served."""
    figures = []
    for name in LOAD_GAUGES:
        [(labels, value)] = scraped[name]
        assert labels == {"model_name": MODEL}
        figures.append(value)
    return tuple(figures)


def stream(url: str, n: int, max_new_tokens: int, out: list[int]) -> None:
    body = json.dumps({"inputs": f"{WORDS} {n}", "parameters": {"max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(url + "/generate_stream", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out.append(sum(line.startswith(b"data:") for line in r))


def test_a_pickers_view_of_two_replicas_one_under_load(replicas):
    """The loaded replica's shard is held (SIGSTOP) while the streams arrive, so the queue is there to
    be seen whatever this machine's speed; then it runs them all."""
    (loaded, idle), _ = replicas
    info = get_json(loaded.url + "/info")[1]
    clients, tokens = 6, 48  # three times the batch: some wait
    done: list[int] = []
    threads = [threading.Thread(target=stream, args=(loaded.url, n, tokens, done)) for n in range(clients)]
    shard = shard_of(loaded)
    os.kill(shard, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        seen, deadline = [], time.monotonic() + 120
        # Every stream arrived: those in the prefill made (at most the batch) run, the others wait.
        while not seen or seen[-1][0][0] + seen[-1][0][1] != clients:
            assert time.monotonic() < deadline, seen[-3:]
            seen.append((load(scrape(loaded.url)), load(scrape(idle.url))))
    finally:
        os.kill(shard, signal.SIGCONT)
    while any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline + 120, seen[-3:]
        seen.append((load(scrape(loaded.url)), load(scrape(idle.url))))
    for t in threads:
        t.join()
    assert done == [tokens] * clients
    busy = [a for a, _ in seen]
    held = [a for a in busy if a[0] + a[1] == clients][0]
    assert held[0] >= clients - info["max_batch_size"] and 1 <= held[1] <= info["max_batch_size"] == 2, held
    for waiting, running, kv in busy:
        # Running may pass the batch size while a request's last token is computed by a call already
        # made and a waiting one has taken its place (docs/operations.md, "Model-server protocol").
        assert waiting + running <= clients and running <= 2 * info["max_batch_size"]
        assert (0 < kv <= 1) if running else kv >= 0, busy
    assert all(b == (0, 0, 0) for _, b in seen)  # the other replica: nothing waits, runs or holds blocks
    assert load(scrape(loaded.url)) == (0, 0, 0)  # cached blocks no request holds count as free
    for srv in (loaded, idle):
        [(labels, value)] = scrape(srv.url)[CACHE_CONFIG_INFO]
        srv_info = get_json(srv.url + "/info")[1]
        assert value == 1 and labels["block_size"] == str(srv_info["block_size"]) == str(BLOCK)
        assert labels["num_gpu_blocks"] == str(srv_info["kv_blocks"]) == str(KV_BLOCKS)
        assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "auto"
