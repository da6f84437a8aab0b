"""The warmup reports a shard streams (shard/warmup.spaced): fewer than one per shape where shapes are
quick, never losing a phase's first or last count or the end."""

from __future__ import annotations

from gaudi_runtime.shard.warmup import spaced


def run(steps: list[tuple[float, tuple[int, int, str]]], interval_s: float = 0.05) -> list[tuple[int, int, str]]:
    """`spaced` over (time, report) pairs, the clock reading each report's time."""
    now = [0.0]

    def progress():
        for at, step in steps:
            now[0] = at
            yield step
    return list(spaced(progress(), interval_s, lambda: now[0]))


def test_quick_shapes_are_reported_once_an_interval_with_each_phase_first_and_last():
    prefill = [(0.01 * i, (i, 10, "prefill")) for i in range(1, 6)]
    decode = [(0.1 + 0.02 * (i - 5), (i, 10, "decode")) for i in range(6, 11)]
    sent = run([*prefill, *decode, (0.3, (10, 10, "done"))])
    assert sent == [(1, 10, "prefill"), (5, 10, "prefill"), (6, 10, "decode"), (9, 10, "decode"),
                    (10, 10, "decode"), (10, 10, "done")]


def test_slow_shapes_are_each_reported():
    steps = [(float(i), (i, 4, "prefill")) for i in range(1, 5)] + [(5.0, (4, 4, "done"))]
    assert run(steps) == [step for _, step in steps]


def test_the_last_count_goes_even_without_an_end():
    assert run([(0.0, (1, 3, "decode")), (0.01, (2, 3, "decode"))]) == [(1, 3, "decode"), (2, 3, "decode")]
    assert run([]) == []
