"""Behaviour of the shard's batched next-token selection (gaudi_runtime.shard.sampling)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.sampling import BatchSampler, gumbel_noise, row_argmax, splitmix64

CPU = torch.device("cpu")
V = 16


def make(params, prompts=None, top_n=None, vocab=V):
    prompts = prompts if prompts is not None else [[] for _ in params]
    top_n = top_n if top_n is not None else [0 for _ in params]
    return BatchSampler(list(params), list(top_n), prompts, vocab, CPU)


def rand_logits(rows, vocab=V, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def full_logprobs(out):
    """The whole distribution, rebuilt from top_n == vocab output."""
    lp = torch.empty_like(out.top_logprobs)
    lp.scatter_(1, out.top_ids, out.top_logprobs)
    return lp


def chi_square(observed, probs):
    n = sum(observed)
    return sum((o - n * p) ** 2 / (n * p) for o, p in zip(observed, probs, strict=True))


# ---------------------------------------------------------------------------- the hash


def _splitmix64_ref(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_splitmix64_matches_unsigned_reference():
    values = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1, 0x1234567890ABCDEF, -0x0FEDCBA987654321]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    for x, h in zip(values, got, strict=True):
        assert h & ((1 << 64) - 1) == _splitmix64_ref(x)


def test_gumbel_noise_is_pure_and_roughly_gumbel():
    offsets = torch.arange(1, 20001, dtype=torch.int64) * -7046029254386353131  # GAMMA as int64
    seeds = torch.tensor([3, 3, 4])
    steps = torch.tensor([0, 0, 0])
    g = gumbel_noise(seeds, steps, offsets)
    assert g.dtype == torch.float32 and g.shape == (3, 20000)
    assert torch.isfinite(g).all()
    assert torch.equal(g[0], g[1])
    assert not torch.equal(g[0], g[2])
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(g.mean().item() - 0.5772) < 0.03
    assert abs(g.var().item() - math.pi**2 / 6) < 0.06


# ---------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_logprobs_and_top_n():
    logits = rand_logits(4)
    s = make([SamplingParameters()] * 4, top_n=[0, 3, 1, 0])
    assert s.counts is None and not s.any_sample  # fast path: nothing but argmax
    out = s(logits)
    lsm = torch.log_softmax(logits, -1)
    assert torch.equal(out.next_ids, logits.argmax(-1))
    assert torch.allclose(out.logprobs, lsm.gather(1, out.next_ids[:, None]).squeeze(1))
    assert out.logprobs.dtype == torch.float32
    assert out.top_ids.shape == (4, 3) and out.top_logprobs.shape == (4, 3)
    ref_lp, ref_ids = torch.topk(lsm, 3, dim=-1)
    assert torch.equal(out.top_ids, ref_ids)
    assert torch.allclose(out.top_logprobs, ref_lp)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 8000, 32001])
def test_row_argmax_is_torchs_argmax_ties_and_infinities_included(vocab):
    g = torch.Generator().manual_seed(vocab)
    scores = torch.randint(-3, 3, (6, vocab), generator=g).float()  # many ties
    scores[1] = float("-inf")  # a row a grammar forbids entirely
    scores[2, -1] = float("inf")
    scores[3, 0] = float("nan")
    scores[4] = torch.randn(vocab, generator=g)
    assert row_argmax(scores).tolist() == torch.argmax(scores, dim=-1).tolist()


def test_no_top_n_gives_none():
    out = make([SamplingParameters(), SamplingParameters(do_sample=True, seed=1)])(rand_logits(2))
    assert out.top_ids is None and out.top_logprobs is None


def test_padded_logits_rows_are_ignored():
    params = [SamplingParameters(), SamplingParameters(do_sample=True, seed=5, top_k=4)]
    logits = rand_logits(2)
    padded = torch.cat([logits, torch.full((6, V), float("nan"))])
    a = make(params, top_n=[2, 2])(logits)
    b = make(params, top_n=[2, 2])(padded)
    assert a.next_ids.shape == (2,)
    assert torch.equal(a.next_ids, b.next_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.top_ids, b.top_ids)


def test_bad_logits_shape_is_rejected():
    s = make([SamplingParameters()] * 3)
    with pytest.raises(ValueError):
        s(rand_logits(2))
    with pytest.raises(ValueError):
        s(rand_logits(3, vocab=V + 1))


# ---------------------------------------------------------------------------- seeded sampling


def _run_row(params, logits_steps, position, batch_size, other_seed=1000):
    """Tokens of the request ``params`` placed at ``position`` in a batch of unrelated requests."""
    rows = [
        SamplingParameters(do_sample=True, seed=other_seed + i, temperature=0.9) for i in range(batch_size)
    ]
    rows[position] = params
    s = make(rows)
    tokens = []
    for step_logits in logits_steps:
        logits = rand_logits(batch_size, seed=12345)  # other rows see different logits
        logits[position] = step_logits
        tokens.append(s(logits).next_ids[position].item())
    return tokens


def test_same_seed_same_tokens_in_any_batch_composition_and_position():
    params = SamplingParameters(do_sample=True, seed=42, temperature=1.3, top_k=10, top_p=0.95)
    steps = [rand_logits(1, seed=100 + t, scale=1.0)[0] for t in range(12)]
    alone = _run_row(params, steps, 0, 1)
    assert _run_row(params, steps, 3, 5) == alone
    assert _run_row(params, steps, 0, 8, other_seed=7) == alone
    assert _run_row(params, steps, 7, 8) == alone


def test_huge_seed_is_accepted():
    s = make([SamplingParameters(do_sample=True, seed=(1 << 64) - 1)])
    assert 0 <= s(rand_logits(1)).next_ids.item() < V


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(64, V)  # uniform: any two seeds agree by chance only 1/V of the time
    a = make([SamplingParameters(do_sample=True, seed=i) for i in range(64)])(logits).next_ids
    b = make([SamplingParameters(do_sample=True, seed=i + 64) for i in range(64)])(logits).next_ids
    assert (a != b).sum().item() > 40
    assert len(set(a.tolist())) > 8


def test_steps_change_the_noise():
    s = make([SamplingParameters(do_sample=True, seed=9)])
    logits = torch.zeros(1, V)
    tokens = [s(logits).next_ids.item() for _ in range(40)]
    assert len(set(tokens)) > 8


def test_top_k_1_equals_greedy():
    logits = rand_logits(6, scale=0.3)
    greedy = make([SamplingParameters()] * 6)(logits).next_ids
    s = make([SamplingParameters(do_sample=True, top_k=1, seed=i, temperature=3.0) for i in range(6)])
    for _ in range(5):
        assert torch.equal(s(logits).next_ids, greedy)


def test_tiny_top_p_picks_the_argmax():
    logits = rand_logits(6, scale=0.3)
    s = make([SamplingParameters(do_sample=True, top_p=1e-6, seed=i) for i in range(6)])
    for _ in range(5):
        assert torch.equal(s(logits).next_ids, logits.argmax(-1))


def _draws(params_for_seed, logits_row, n=4000, steps=2):
    """Counts over ``n`` draws: n/steps rows with distinct seeds, each sampled ``steps`` times."""
    rows = n // steps
    s = make([params_for_seed(seed) for seed in range(rows)], vocab=logits_row.numel())
    counts = torch.zeros(logits_row.numel(), dtype=torch.int64)
    logits = logits_row.expand(rows, -1).clone()
    for _ in range(steps):
        counts += torch.bincount(s(logits).next_ids, minlength=logits_row.numel())
    return counts.tolist()


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    probs = torch.softmax(logits, -1).tolist()
    observed = _draws(lambda seed: SamplingParameters(do_sample=True, seed=seed), logits)
    # df = 5; P(chi2 > 20.5) = 0.001. Seeds are fixed, so the test is deterministic.
    assert chi_square(observed, probs) < 20.5


def test_temperature_sharpens_the_distribution_and_logprobs():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    probs = torch.softmax(logits / 0.5, -1).tolist()
    observed = _draws(lambda seed: SamplingParameters(do_sample=True, seed=seed, temperature=0.5), logits)
    assert chi_square(observed, probs) < 20.5
    out = make([SamplingParameters(do_sample=True, temperature=0.5)], top_n=[6], vocab=6)(logits[None])
    assert torch.allclose(full_logprobs(out), torch.log_softmax(logits / 0.5, -1)[None], atol=1e-6)
    assert torch.allclose(out.logprobs, torch.log_softmax(logits / 0.5, -1)[out.next_ids], atol=1e-6)


def test_temperature_alone_turns_sampling_on_like_tgi():
    logits = torch.zeros(32, V)
    logits[:, 0] = 0.5
    s = make([SamplingParameters(temperature=0.9, seed=i) for i in range(32)])
    assert s.all_sample
    assert len(set(s(logits).next_ids.tolist())) > 4


def test_top_k_restricts_and_keeps_proportions():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, 2.0, -1.0])
    observed = _draws(lambda seed: SamplingParameters(do_sample=True, seed=seed, top_k=3), logits)
    assert observed[0] == observed[2] == observed[5] == 0
    kept = torch.softmax(logits[[1, 3, 4]], -1).tolist()
    assert chi_square([observed[1], observed[3], observed[4]], kept) < 13.8  # df = 2, p = 0.001


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()
    # 0.4 + 0.3 = 0.7 < 0.75, so the third token (0.15) is needed; the rest are cut.
    observed = _draws(lambda seed: SamplingParameters(do_sample=True, seed=seed, top_p=0.75), logits)
    assert observed[0] == observed[4] == 0
    assert all(observed[i] > 0 for i in (1, 2, 3))
    kept = (probs[[1, 2, 3]] / probs[[1, 2, 3]].sum()).tolist()
    assert chi_square([observed[1], observed[2], observed[3]], kept) < 13.8
    # logprobs are reported before truncation
    out = make([SamplingParameters(do_sample=True, top_p=0.75)], top_n=[5], vocab=5)(logits[None])
    assert torch.allclose(full_logprobs(out), torch.log_softmax(logits, -1)[None], atol=1e-6)


def _typical_keep_ref(logits_row, mass):
    lp = torch.log_softmax(logits_row.double(), -1)
    p = lp.exp()
    ent = -(lp * p).sum()
    order = sorted(range(len(p)), key=lambda i: abs(-lp[i].item() - ent.item()))
    kept, total = [], 0.0
    for i in order:
        kept.append(i)
        total += p[i].item()
        if total >= mass:
            break
    return set(kept)


def test_typical_p_keeps_the_typical_set():
    # One token at p = 0.3 and ten near p = 0.07: the likeliest token is the *least* typical one
    # (|-log p - H| is largest for it), so typical_p < ~0.7 drops it.
    logits = torch.tensor([math.log(0.3)] + [math.log(0.07) + 0.03 * i for i in range(10)])
    for mass in (0.3, 0.5, 0.9):
        keep = _typical_keep_ref(logits, mass)
        observed = _draws(
            lambda seed, m=mass: SamplingParameters(do_sample=True, seed=seed, typical_p=m), logits
        )
        assert {i for i, c in enumerate(observed) if c > 0} == keep
    assert 0 not in _typical_keep_ref(logits, 0.5)


def test_warpers_combine_and_greedy_rows_stay_greedy():
    logits = rand_logits(6, scale=1.5)
    params = [
        SamplingParameters(do_sample=True, seed=1, temperature=0.7, top_k=5, top_p=0.9, typical_p=0.95),
        SamplingParameters(),
        SamplingParameters(do_sample=True, seed=2, top_p=0.8),
        SamplingParameters(repetition_penalty=3.0),
        SamplingParameters(do_sample=True, seed=3, typical_p=0.7),
        SamplingParameters(),
    ]
    prompts = [[1, 2], [], [3], [int(logits[3].argmax())], [], [4]]
    s = make(params, prompts=prompts)
    for step in range(6):
        out = s(logits)
        assert out.next_ids[1].item() == logits[1].argmax().item()
        assert out.next_ids[5].item() == logits[5].argmax().item()
        if step == 0:  # row 3's argmax was in its prompt: the penalty moved it
            assert out.next_ids[3].item() != logits[3].argmax().item()
        assert s.steps.tolist() == [step + 1] * 6


# ---------------------------------------------------------------------------- penalties


def test_repetition_penalty_reduces_a_seen_token():
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0, 1.0, -2.0]])
    out = make([SamplingParameters(repetition_penalty=2.0)], prompts=[[0, 2, 2]], top_n=[6], vocab=6)(logits)
    expected = logits.clone()
    expected[0, 0] = 1.5  # positive: divided
    expected[0, 2] = -2.0  # negative: multiplied (once, however often it was seen)
    assert out.next_ids.item() == 1  # the seen argmax lost to the next one
    assert torch.allclose(full_logprobs(out), torch.log_softmax(expected, -1), atol=1e-6)
    # sampled rows: a seen token becomes rarer
    rows = 3000
    pos = torch.ones(rows, V)

    def token0(penalty):
        s = make(
            [
                SamplingParameters(do_sample=True, seed=seed, repetition_penalty=penalty)
                for seed in range(rows)
            ],
            prompts=[[0]] * rows,
        )
        return torch.bincount(s(pos).next_ids, minlength=V)[0].item()

    base, penalised = token0(1.0), token0(3.0)
    # expected: 3000/16 = 187 without, 3000 * e^(1/3) / (15e + e^(1/3)) = 99 with the penalty
    assert base > 150 and penalised < 130


def test_repetition_penalty_counts_generated_tokens():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7]])
    s = make([SamplingParameters(repetition_penalty=10.0)], prompts=[[]], vocab=4)
    # each chosen token is penalised from then on, so greedy walks down the list
    assert [s(logits).next_ids.item() for _ in range(4)] == [0, 1, 2, 3]


def test_frequency_penalty_semantics():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    s = make([SamplingParameters(frequency_penalty=0.6)], prompts=[[1, 1, 2]], top_n=[5], vocab=5)
    out = s(logits)
    # TGI: subtract penalty * count / length over prompt + generated tokens
    expected = logits - 0.6 * torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]]) / 3
    assert torch.allclose(full_logprobs(out), torch.log_softmax(expected, -1), atol=1e-6)
    assert out.next_ids.item() == 0  # first of the unpenalised maxima
    out = s(logits)  # now 4 tokens: [1, 1, 2, 0]
    expected = logits - 0.6 * torch.tensor([[1.0, 2.0, 1.0, 0.0, 0.0]]) / 4
    assert torch.allclose(full_logprobs(out), torch.log_softmax(expected, -1), atol=1e-6)
    assert out.next_ids.item() == 3
    # negative penalty encourages repetition
    out = make([SamplingParameters(frequency_penalty=-1.0)], prompts=[[2]], vocab=5)(logits)
    assert out.next_ids.item() == 2


def test_openai_penalties_count_generated_tokens_only():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.0]])
    p = SamplingParameters(generated_frequency_penalty=0.25, presence_penalty=0.5)
    s = make([p], prompts=[[0, 0, 0]], top_n=[5], vocab=5)
    out = s(logits)
    # OpenAI: logit -= frequency * n + presence * (n > 0), n = times generated; the prompt does not count
    assert torch.allclose(full_logprobs(out), torch.log_softmax(logits, -1), atol=1e-6)
    assert out.next_ids.item() == 0
    for expected_n, want in [([1, 0, 0, 0, 0], 1), ([1, 1, 0, 0, 0], 2)]:
        out = s(logits)
        n = torch.tensor([expected_n], dtype=torch.float32)
        expected = logits - 0.25 * n - 0.5 * (n > 0).float()
        assert torch.allclose(full_logprobs(out), torch.log_softmax(expected, -1), atol=1e-6)
        assert out.next_ids.item() == want
    assert s.generated_counts[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert s.counts is None  # no penalty over the prompt: its counts are not kept


def test_high_presence_penalty_forbids_repeats_in_greedy_decoding():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    plain = make([SamplingParameters()], vocab=6)
    assert [plain(logits).next_ids.item() for _ in range(4)] == [0, 0, 0, 0]
    s = make([SamplingParameters(presence_penalty=2.0, generated_frequency_penalty=2.0)], vocab=6)
    assert [s(logits).next_ids.item() for _ in range(4)] == [0, 1, 2, 3]
    # a negative presence penalty favours what was already generated
    first, then = torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[2.0, 3.0, 0.0]])
    for presence, want in [(0.0, 1), (-2.0, 0)]:
        s = make([SamplingParameters(presence_penalty=presence)], vocab=3)
        assert s(first).next_ids.item() == 0
        assert s(then).next_ids.item() == want


def test_openai_penalties_keep_per_row_state_through_filter_and_concat():
    logits = rand_logits(3, scale=0.5)
    params = [
        SamplingParameters(presence_penalty=1.5),
        SamplingParameters(do_sample=True, seed=3),
        SamplingParameters(do_sample=True, seed=4, generated_frequency_penalty=0.7, repetition_penalty=1.3),
    ]
    prompts = [[1], [2], [3, 3]]
    s = make(params, prompts=prompts)
    refs = [make([p], prompts=[pr]) for p, pr in zip(params, prompts, strict=True)]
    for _ in range(3):
        out = s(logits)
        for i, r in enumerate(refs):
            assert out.next_ids[i].item() == r(logits[i : i + 1]).next_ids.item()
    assert s.filter([1]).generated_counts is None  # that row uses no such penalty
    f = BatchSampler.concat([s.filter([2]), s.filter([0]), make([SamplingParameters()])])
    assert f.generated_counts.shape == (3, V) and f.generated_counts[2].sum().item() == 0
    sub = torch.stack([logits[2], logits[0], logits[1]])
    for _ in range(3):
        out = f(sub)
        assert out.next_ids[0].item() == refs[2](logits[2:3]).next_ids.item()
        assert out.next_ids[1].item() == refs[0](logits[0:1]).next_ids.item()
    assert torch.equal(f.generated_counts[0], refs[2].generated_counts[0])
    assert torch.equal(f.counts[0], refs[2].counts[0])


def test_openai_penalties_have_no_data_dependent_host_sync():
    params = [SamplingParameters(presence_penalty=1.0, generated_frequency_penalty=-0.5), SamplingParameters()]
    s = BatchSampler(params, [0, 2], [[1, 2], [3]], 32, torch.device("meta"))
    assert s(torch.empty(2, 32, device="meta")).next_ids.shape == (2,)


def test_penalties_apply_before_temperature():
    logits = torch.tensor([[2.0, 1.0, -1.0]])
    p = SamplingParameters(do_sample=True, temperature=0.5, repetition_penalty=2.0, frequency_penalty=0.3)
    out = make([p], prompts=[[0, 2]], top_n=[3], vocab=3)(logits)
    expected = torch.tensor([[1.0, 1.0, -2.0]]) - 0.3 * torch.tensor([[1.0, 0.0, 1.0]]) / 2
    assert torch.allclose(full_logprobs(out), torch.log_softmax(expected / 0.5, -1), atol=1e-6)


def test_counts_kept_only_when_a_row_uses_a_penalty():
    assert make([SamplingParameters(), SamplingParameters(do_sample=True)]).counts is None
    s = make([SamplingParameters(), SamplingParameters(repetition_penalty=1.2)], prompts=[[1, 1], [2, 3, 3]])
    assert s.counts.shape == (2, V)
    assert s.counts[0].sum().item() == 0  # unpenalised row: not tracked
    assert s.counts[1, 3].item() == 2
    assert s.filter([0]).counts is None
    with pytest.raises(ValueError):
        make([SamplingParameters(repetition_penalty=1.2)], prompts=[[V]])


# ---------------------------------------------------------------------------- filter / concat


def test_filter_keeps_per_row_state():
    logits = rand_logits(3, scale=0.5)
    params = [
        SamplingParameters(do_sample=True, seed=11),
        SamplingParameters(repetition_penalty=5.0),
        SamplingParameters(do_sample=True, seed=33, frequency_penalty=0.5),
    ]
    prompts = [[1], [2, 3], [4, 4]]
    s = make(params, prompts=prompts, top_n=[1, 2, 0])
    refs = [make([p], prompts=[pr], top_n=[n]) for p, pr, n in zip(params, prompts, [1, 2, 0], strict=True)]
    for _ in range(3):
        out = s(logits)
        for i, r in enumerate(refs):
            assert out.next_ids[i].item() == r(logits[i : i + 1]).next_ids.item()
    f = s.filter([2, 1])
    assert f.steps.tolist() == [3, 3]
    assert f.lengths.tolist() == [5, 5]
    assert torch.equal(f.counts, s.counts[[2, 1]])
    assert f.top_n_tokens == [0, 2] and f.max_top_n == 2
    sub = torch.stack([logits[2], logits[1]])
    for _ in range(3):
        out = f(sub)
        assert out.next_ids[0].item() == refs[2](logits[2:3]).next_ids.item()
        assert out.next_ids[1].item() == refs[1](logits[1:2]).next_ids.item()
    assert torch.equal(f.counts[0], refs[2].counts[0])
    assert torch.equal(f.counts[1], refs[1].counts[0])


def test_concat_keeps_per_row_state():
    la = rand_logits(2, seed=1, scale=0.5)
    lb = rand_logits(1, seed=2, scale=0.5)
    pa = [SamplingParameters(do_sample=True, seed=5), SamplingParameters()]
    pb = [SamplingParameters(do_sample=True, seed=6, repetition_penalty=2.0, top_k=8)]
    a, b = make(pa, prompts=[[1], [2]]), make(pb, prompts=[[3, 4, 5]], top_n=[2])
    ra = [make([p], prompts=[pr]) for p, pr in zip(pa, [[1], [2]], strict=True)]
    rb = make(pb, prompts=[[3, 4, 5]], top_n=[2])
    for _ in range(2):
        a(la)
        for i, r in enumerate(ra):
            r(la[i : i + 1])
    b(lb)
    rb(lb)
    c = BatchSampler.concat([a, b])
    assert c.steps.tolist() == [2, 2, 1]
    assert c.lengths.tolist() == [3, 3, 4]
    assert c.counts.shape == (3, V) and c.counts[:2].sum().item() == 0
    assert torch.equal(c.counts[2], rb.counts[0])
    assert c.top_n_tokens == [0, 0, 2]
    logits = torch.cat([la, lb])
    for _ in range(4):
        out = c(logits)
        assert out.top_ids.shape == (3, 2)
        assert out.next_ids[0].item() == ra[0](la[0:1]).next_ids.item()
        assert out.next_ids[1].item() == ra[1](la[1:2]).next_ids.item()
        ref = rb(lb)
        assert out.next_ids[2].item() == ref.next_ids.item()
        assert torch.equal(out.top_ids[2], ref.top_ids[0])
    # concat then filter back to a single row equals the original row
    back = c.filter([2])
    assert back.steps.tolist() == [5]
    assert torch.equal(back.counts, rb.counts)


def test_mixed_batch_greedy_and_sampled():
    logits = rand_logits(6, scale=0.5)
    params = [SamplingParameters(do_sample=(i % 2 == 1), seed=100 + i) for i in range(6)]
    s = make(params, top_n=[3] * 6)
    singles = [make([p], top_n=[3]) for p in params]
    for _ in range(5):
        out = s(logits)
        for i in range(6):
            ref = singles[i](logits[i : i + 1])
            assert out.next_ids[i].item() == ref.next_ids.item()
            assert torch.allclose(out.logprobs[i], ref.logprobs[0])
            if i % 2 == 0:
                assert out.next_ids[i].item() == logits[i].argmax().item()
    # sampled rows do not always follow the argmax
    sampled = make([SamplingParameters(do_sample=True, seed=i) for i in range(50)])(
        torch.zeros(50, V) + torch.linspace(0, 0.5, V)
    ).next_ids
    assert (sampled != V - 1).any()


def test_zero_temperature_is_greedy():
    logits = rand_logits(3)
    s = make([SamplingParameters(do_sample=True, temperature=0.0, seed=i) for i in range(3)])
    assert not s.any_sample
    assert torch.equal(s(logits).next_ids, logits.argmax(-1))


def test_call_has_no_data_dependent_host_sync():
    """On the meta device any .item()/nonzero/boolean indexing/tolist would raise: __call__ has none."""
    params = [
        SamplingParameters(),
        SamplingParameters(
            do_sample=True,
            seed=1,
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            typical_p=0.9,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
        ),
    ]
    s = BatchSampler(params, [2, 3], [[1, 2], [3]], 32, torch.device("meta"))
    out = s(torch.empty(4, 32, device="meta"))
    assert out.next_ids.shape == (2,) and out.top_ids.shape == (2, 3)
    s = BatchSampler.concat([s.filter([1]), s.filter([0])])
    assert s(torch.empty(2, 32, device="meta")).logprobs.shape == (2,)


# ---------------------------------------------------------------------------- grammar masks


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    """A grammar cache over the tiny models' byte-level vocabulary (EOS is id 1)."""
    from gaudi_runtime.shard.grammar import GrammarCache
    from gaudi_runtime.tools.tiny_model import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer()
    tok.save_pretrained(d)
    cache = GrammarCache(str(d), len(tok), [1])
    cache.tokenizer = tok
    return cache


_grammar_ids = itertools.count(1)


def _matcher(cache, kind: str, value: str):
    """A matcher of a grammar compiled under a fresh id, as a prefill gets one."""
    grammar_id = next(_grammar_ids)
    cache.compile(grammar_id, kind, value)
    return cache.matcher(grammar_id)


def test_allowed_tokens_unpacks_xgrammars_bit_order():
    from gaudi_runtime.shard.grammar import allowed_tokens

    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = 1 | (1 << 5)
    bitmask[0, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    bitmask[1] = -1
    allowed = allowed_tokens(bitmask, 40)  # a vocabulary that is no multiple of 32: the tail is cut
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 5]
    assert allowed[1].all()
    assert allowed_tokens(bitmask, 64)[0].nonzero().flatten().tolist() == [0, 5, 63]


def _generate(sampler, steps, vocab, seed=0):
    """Run `sampler` on random logits as the runner does (fill, sample, accept); the token ids per row."""
    out = [[] for _ in range(len(sampler))]
    for step in range(steps):
        bitmask = sampler.grammar.fill(len(sampler) + 3) if sampler.grammar is not None else None  # padded rows
        ids = sampler(rand_logits(len(sampler) + 3, vocab, seed=seed * 1000 + step, scale=3.0), bitmask).next_ids
        sampler.accept(ids.tolist())
        for i, t in enumerate(ids.tolist()):
            out[i].append(t)
    return out


def _text(tok, ids):
    ids = ids[:ids.index(1)] if 1 in ids else ids
    return tok.decode(ids)


def test_grammar_rows_take_only_what_their_grammar_allows(grammars):
    import re

    from gaudi_runtime.shard.grammar import GrammarRows

    tok, vocab = grammars.tokenizer, grammars.vocab_size
    regex = "(yes|no|maybe)-[0-9]{2}"
    params = [SamplingParameters(do_sample=True, seed=s) for s in range(4)] + [SamplingParameters()]
    rows = GrammarRows.of(grammars, [_matcher(grammars, "regex", regex) for _ in range(4)] + [None])
    sampler = BatchSampler(params, [0] * 5, [[]] * 5, vocab, CPU, rows)
    out = _generate(sampler, 12, vocab)
    for ids in out[:4]:
        assert 1 in ids, "the grammar ends: the only token it then allows is EOS"
        assert re.fullmatch(regex, _text(tok, ids))
        assert set(ids[ids.index(1):]) == {1}, "a step past the end may take only EOS"
    assert not re.fullmatch(regex, _text(tok, out[4]))  # the unconstrained row is free


def test_grammar_state_survives_filter_and_concat(grammars):
    import json

    from gaudi_runtime.shard.grammar import GrammarRows

    tok, vocab = grammars.tokenizer, grammars.vocab_size
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
                         "required": ["a", "b"]})
    first = BatchSampler([SamplingParameters(do_sample=True, seed=s) for s in range(3)], [0] * 3, [[]] * 3, vocab,
                         CPU, GrammarRows.of(grammars, [_matcher(grammars, "json", schema), None,
                                                        _matcher(grammars, "regex", "[a-c]{12}")]))
    head = _generate(first, 3, vocab, seed=1)
    kept = first.filter([2, 0])  # the unconstrained row leaves
    joining = BatchSampler([SamplingParameters(do_sample=True, seed=9)], [0], [[]], vocab, CPU,
                           GrammarRows.of(grammars, [_matcher(grammars, "regex", "z+!")]))
    merged = BatchSampler.concat([kept, joining, make([SamplingParameters()], vocab=vocab)])
    tail = _generate(merged, 30, vocab, seed=2)
    assert json.loads(_text(tok, head[0] + tail[1])) in ({"a": a, "b": b} for a in "xy" for b in (True, False))
    abc = _text(tok, head[2] + tail[0])
    assert len(abc) == 12 and set(abc) <= set("abc")
    assert _text(tok, tail[2]).rstrip("!").strip("z") == "" and _text(tok, tail[2]).endswith("!")


def test_bad_grammars_fail_with_xgrammars_reason_once(grammars):
    from gaudi_runtime.shard.grammar import GrammarError

    with pytest.raises(GrammarError, match="parenthesis is not closed"):
        grammars.compile(9001, "regex", "(ab")
    assert not grammars.cached(9001)  # nothing kept: the router remembers the error
    with pytest.raises(GrammarError, match="not compiled on this shard"):
        grammars.matcher(9001)
    with pytest.raises(GrammarError, match="Type should be a string"):
        grammars.compile(9002, "json", '{"type": 5}')
    with pytest.raises(GrammarError, match="unknown grammar type"):
        grammars.compile(9003, "yaml", "a: 1")


def test_a_grammar_is_kept_by_id_until_forgotten_and_compiled_once(grammars):
    from gaudi_runtime.shard.grammar import GrammarError

    before = grammars.compilations
    grammars.compile(8001, "regex", "[0-9]+")
    grammars.compile(8001, "regex", "[0-9]+")  # asked again under its id: already there
    assert grammars.compilations == before + 1 and grammars.cached(8001)
    grammars.matcher(8001)
    grammars.forget([8001])
    assert not grammars.cached(8001)
    with pytest.raises(GrammarError, match="not compiled on this shard"):
        grammars.matcher(8001)
    grammars.forget([8002])  # forgotten while its compilation was still to run (the router gave up on it)
    grammars.compile(8002, "regex", "[a-z]+")
    assert not grammars.cached(8002)


def test_string_length_bounds_yield_valid_json_strings(grammars):
    import json

    from gaudi_runtime.shard.grammar import GrammarRows

    tok, vocab = grammars.tokenizer, grammars.vocab_size
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6}},
                         "required": ["s"]})
    n = 16
    sampler = BatchSampler([SamplingParameters(do_sample=True, seed=s) for s in range(n)], [0] * n, [[]] * n, vocab,
                           CPU, GrammarRows.of(grammars, [_matcher(grammars, "json", schema) for _ in range(n)]))
    for ids in _generate(sampler, 30, vocab, seed=3):
        value = json.loads(_text(tok, ids))["s"]  # strict JSON: no raw control characters
        assert 2 <= len(value) <= 6 and "\ufffd" not in value  # nor a surrogate, decoded as U+FFFD
