"""Length distributions, the Poisson arrival schedule and prompt building of `gaudi-serve loadtest`."""

from __future__ import annotations

import random
import statistics

import pytest

from gaudi_runtime.bench.profiles import (
    CHAT_OUTPUT_HISTOGRAM,
    CHAT_PROMPT_HISTOGRAM,
    LengthSpecError,
    PromptMaker,
    chat_text,
    parse_length,
    poisson_schedule,
)


def draws(spec: str, n: int = 4000, cap: int | None = None, seed: int = 0) -> list[int]:
    d = parse_length(spec, cap)
    rng = random.Random(seed)
    return [d.sample(rng) for _ in range(n)]


def test_constant_uniform_choice():
    assert set(draws("128", 50)) == {128}
    u = draws("uniform:10:20")
    assert min(u) == 10 and max(u) == 20 and set(u) == set(range(10, 21))
    c = draws("choice:8,8,200")
    assert set(c) == {8, 200}
    assert 0.6 < c.count(8) / len(c) < 0.73


def test_normal_and_lognormal_centres():
    assert statistics.mean(draws("normal:200:20")) == pytest.approx(200, rel=0.03)
    assert statistics.median(draws("lognormal:100:0.5")) == pytest.approx(100, rel=0.08)
    assert min(draws("normal:2:50")) >= 1  # clipped below at 1


def test_cap_clips_every_sample():
    assert max(draws("chat-prompt", cap=64)) == 64
    assert max(draws("uniform:1:1000", cap=100)) == 100


@pytest.mark.parametrize("name,hist", [("chat-prompt", CHAT_PROMPT_HISTOGRAM), ("chat-output", CHAT_OUTPUT_HISTOGRAM)])
def test_chat_histograms_are_sampled_in_proportion(name, hist):
    xs = draws(name, 20000)
    lo, hi = hist[0][0], hist[-1][1]
    assert lo <= min(xs) and max(xs) <= hi
    total = sum(w for _, _, w in hist)
    for a, b, w in hist:
        share = sum(a <= x <= b for x in xs) / len(xs)
        assert share == pytest.approx(w / total, abs=0.015), (a, b)
    assert statistics.mean(xs) == pytest.approx(parse_length(name).mean(), rel=0.05)


def test_chat_histograms_are_long_tailed():
    xs = draws("chat-prompt", 20000)
    assert statistics.mean(xs) > 1.5 * statistics.median(xs)


@pytest.mark.parametrize("spec", ["0", "uniform:5:2", "uniform:x:3", "normal:-1:3", "choice:", "zipf:2", ""])
def test_bad_specs_are_refused(spec):
    with pytest.raises(LengthSpecError):
        parse_length(spec)


def test_poisson_schedule_rate_and_shape():
    rng = random.Random(1)
    t = poisson_schedule(5.0, 20000, rng)
    assert len(t) == 20000
    assert all(b > a for a, b in zip(t, t[1:])) and t[0] > 0
    gaps = [b - a for a, b in zip([0.0, *t], t)]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean, P(gap > mean) = 1/e
    assert statistics.pstdev(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert sum(g > 0.2 for g in gaps) / len(gaps) == pytest.approx(0.3679, abs=0.015)


def test_poisson_schedule_is_deterministic_and_bounded_by_duration():
    a = poisson_schedule(10, 1000, random.Random(7), duration_s=3.0)
    b = poisson_schedule(10, 1000, random.Random(7), duration_s=3.0)
    assert a == b and a and max(a) < 3.0
    assert 15 < len(a) < 50  # ~ 30 expected
    assert len(poisson_schedule(10, 4, random.Random(7))) == 4
    with pytest.raises(ValueError):
        poisson_schedule(0, 3, random.Random(0))


def test_chat_text_and_estimated_prompts():
    text = chat_text(random.Random(0), 50)
    assert len(text.split()) == 50 and text.startswith("Hello!")
    prompt, n, how = PromptMaker().make(random.Random(0), 130)
    assert how == "estimate" and n == 130 and len(prompt.split()) == 100


class CharTokenizer:
    """One token per character; enough to check the window logic without a model."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def __call__(self, text):
        class R:
            input_ids = self.encode(text)
        return R()


def test_prompts_with_a_tokenizer_have_the_target_length():
    maker = PromptMaker(CharTokenizer(), seed=0)
    rng = random.Random(0)
    for n in (1, 7, 64, 500):
        prompt, counted, how = maker.make(rng, n)
        assert how == "tokenizer" and counted == len(prompt) and n - 2 <= counted <= n
