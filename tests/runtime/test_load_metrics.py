"""The load gauges under vLLM's names on a real `gaudi-serve launch` (tiny model, CPU): absent while
the server loads and warms up (an autoscaler must not read a starting pod as idle or busy), at zero
once it is ready, and following the requests waiting, running and the KV blocks they hold.

The shard is held with SIGSTOP while requests queue, so the figures stand still while they are read.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gaudi_runtime.router.metrics import LOAD_GAUGES
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import (
    alive,
    get_json,
    hold_mid_warmup,
    launch,
    run_in_slices,
    shard_of,
    signal_all,
)

MODEL_NAME = "tiny-llama"


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Samples of the load gauges: name -> {labels: value}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out: dict[str, dict[tuple, float]] = {name: {} for name in LOAD_GAUGES}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def tgi_gauge(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def load(url: str) -> tuple[float, float, float]:
    samples = scrape(url)
    label = (("model_name", MODEL_NAME),)
    return tuple(samples[name][label] for name in LOAD_GAUGES)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A server started with a warmup of many shapes; every (gauges, health after them) seen on the way."""
    tmp = tmp_path_factory.mktemp("load")
    model_dir = make_tiny_model(tmp / "llama", "llama")
    srv = launch(model_dir, tmp, "--max-input-tokens", "256", "--max-total-tokens", "512", "--max-batch-size", "32",
                 "--model-name", MODEL_NAME, env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "2",
                                                  "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    seen = []
    deadline = time.monotonic() + 240
    try:
        shards, _ = hold_mid_warmup(srv.proc, srv.url)
        try:  # one look mid-warmup, whatever this machine's speed
            gauges = scrape(srv.url)
            seen.append((gauges, *get_json(srv.url + "/health", timeout=5)))
        finally:
            signal_all(shards, signal.SIGCONT)
        while time.monotonic() < deadline:
            assert srv.proc.poll() is None, srv.log()[-3000:]
            try:
                gauges = scrape(srv.url)
                code, body = get_json(srv.url + "/health", timeout=5)
            except OSError:
                time.sleep(0.05)  # poll interval of a deadline-bounded wait (the server is not up yet)
                continue
            seen.append((gauges, code, body))
            if code == 200:
                break
        yield srv, seen
    finally:
        srv.stop()


def test_no_load_figure_until_ready_then_zeros(started):
    srv, seen = started
    assert seen and seen[-1][1] == 200, "the server did not become ready"
    # The gauges were read before /health: a server not ready after them was not ready when read.
    starting = [(gauges, body) for gauges, code, body in seen if code != 200]
    assert any(body.get("status") == "warming_up" for _, body in starting), [b for _, b in starting][:3]
    for gauges, body in starting:
        assert gauges == {name: {} for name in LOAD_GAUGES}, (body, gauges)
    assert load(srv.url) == (0, 0, 0)


def test_gauges_follow_waiting_and_running_requests_and_kv_blocks(started):
    srv, _ = started
    results: list[int] = []

    def stream(n: int) -> None:
        # The first one long enough to still run while the others queue (the shard runs it in slices).
        body = json.dumps({"inputs": f"Load {n}", "parameters": {"max_new_tokens": 400 if n == 0 else 40}}).encode()
        req = urllib.request.Request(srv.url + "/generate_stream", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            results.append(sum(line.startswith(b"data:") for line in r))

    shard = shard_of(srv)
    first, more = threading.Thread(target=stream, args=(0,)), []
    os.kill(shard, signal.SIGSTOP)  # held from before the first request: it cannot end before it is seen
    try:
        first.start()
        # A few tokens a slice (5 ms at most), until the first request is in the batch; left stopped then,
        # so the batch stands still and what arrives now waits.
        run_in_slices(lambda: [shard], lambda: load(srv.url)[1] >= 1, timeout_s=120, slice_max_s=0.005)
        more = [threading.Thread(target=stream, args=(n,)) for n in range(1, 5)]
        for t in more:
            t.start()
        deadline = time.monotonic() + 120
        while (figures := load(srv.url))[0] < 4:
            assert time.monotonic() < deadline, figures
            time.sleep(0.02)  # poll interval of a deadline-bounded wait
        waiting, running, kv = figures
        assert (waiting, running) == (4, 1) and 0 < kv < 1, figures
        # TGI's gauge of the running batch: its prompt tokens plus the 400 it may generate.
        assert 400 < tgi_gauge(srv.url, "tgi_batch_current_max_tokens") < 450
        assert get_json(srv.url + "/health")[0] == 200  # a busy server is still ready
    finally:
        if alive(shard):
            os.kill(shard, signal.SIGCONT)
    for t in [first, *more]:
        t.join(120)
    assert sorted(results) == [40, 40, 40, 40, 400]
    assert load(srv.url) == (0, 0, 0)
