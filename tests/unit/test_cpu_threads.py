"""A CPU shard gives up a thread while other processes need its cores, and takes it back after."""

import subprocess
import sys
import time

import pytest

from gaudi_runtime.device.cpu_threads import (
    AdaptiveThreads,
    CoreUse,
    ThreadPolicy,
    adaptive_threads,
    busy_ticks,
    next_threads,
    own_ticks,
)

POLICY = ThreadPolicy(most=4, drop_at=0.35, restore_at=0.15, window_s=1.0)


def test_threads_drop_under_load_and_come_back_when_it_is_gone():
    assert next_threads(POLICY, 4, 0.0) == 4
    assert next_threads(POLICY, 4, 0.9) == 3
    assert next_threads(POLICY, 3, 0.05) == 4


def test_a_load_between_the_thresholds_keeps_the_count():
    assert next_threads(POLICY, 4, 0.25) == 4
    assert next_threads(POLICY, 3, 0.25) == 3


def test_one_thread_is_never_given_up():
    assert next_threads(ThreadPolicy(most=1), 1, 2.0) == 1


STAT = """cpu  900 0 900 9000 0 0 0 0 0 0
cpu0 100 5 50 1000 20 3 2 1 7 0
cpu1 200 0 100 2000 0 0 0 0 0 0
cpu2 400 0 400 9000 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_ticks_count_the_given_cpus_without_idle_or_iowait():
    assert busy_ticks(STAT, {0}) == 100 + 5 + 50 + 3 + 2 + 1
    assert busy_ticks(STAT, {0, 1}) == 161 + 300
    assert busy_ticks(STAT, {7}) == 0


def test_own_ticks_read_past_a_process_name_with_spaces_and_parentheses():
    fields = ["S", *["0"] * 10, "250", "40", *["0"] * 30]
    assert own_ticks(f"1234 (python3 (x) y) {' '.join(fields)}") == 290


class FakeUse:
    cpus = {0, 1}

    def __init__(self):
        self.readings: list[tuple[float, float]] = []

    def others(self):
        return self.readings.pop(0)


def make_adjuster(most=2):
    now = [0.0]
    use, calls = FakeUse(), []
    adj = AdaptiveThreads(ThreadPolicy(most=most, window_s=1.0), use, calls.append, clock=lambda: now[0])
    return adj, use, calls, now


def test_the_adjuster_decides_once_a_window_and_sets_only_changes():
    adj, use, calls, now = make_adjuster()
    assert calls == [2]
    now[0] = 0.5
    assert adj.adjust() == 2  # inside the first window: no reading taken
    now[0] = 1.0
    use.readings = [(1.0, 0.8)]
    assert adj.adjust() == 1
    now[0] = 2.0
    use.readings = [(1.0, 0.9)]
    assert adj.adjust() == 1
    now[0] = 3.0
    use.readings = [(1.0, 0.05)]
    assert adj.adjust() == 2
    assert calls == [2, 1, 2]


def test_a_window_that_spans_an_idle_shard_is_not_acted_on():
    adj, use, calls, now = make_adjuster()
    now[0] = 30.0
    use.readings = [(30.0, 1.5)]  # a client starting up while the shard had nothing to do
    assert adj.adjust() == 2
    assert calls == [2]


def test_no_adjuster_for_a_single_thread():
    assert adaptive_threads(1, 1, {0}, lambda n: None) is None


@pytest.fixture
def busy_process():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_core_use_sees_another_process_spinning(busy_process):
    import os

    deadline = time.monotonic() + 30
    seen: list[float] = []
    while not seen or (seen[-1] < 0.5 and time.monotonic() < deadline):
        use = CoreUse(os.sched_getaffinity(0), shards=1)
        window_end = time.monotonic() + 0.5
        while time.monotonic() < window_end:
            time.sleep(0.05)  # poll interval: a window must pass before the reading means anything
        seen.append(use.others()[1])
    assert seen[-1] >= 0.5, seen
