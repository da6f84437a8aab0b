"""N-gram drafting and the speculative step's sampling, without a model: what each row drafts, when it
backs off, and that verifying drafts emits exactly the tokens plain decoding would."""

from __future__ import annotations

import numpy as np
import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.sampling import BatchSampler
from gaudi_runtime.shard.speculation import MAX_SKIP, DraftRows, RowTokens, SpecStats, ngram_draft
from gaudi_runtime.shard.step_sampling import verify

V = 50


def test_the_draft_is_what_followed_the_latest_occurrence_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3])
    # "1 2 3" (3 tokens) occurred at 0, followed by 4 9 2; "2 3" alone would have matched later, at 5.
    assert ngram_draft(tokens, 3).tolist() == [4, 9, 2]
    assert ngram_draft(np.array([7, 8, 1, 7, 8, 2, 7, 8]), 2).tolist() == [2, 7]  # the latest "7 8"
    assert ngram_draft(np.array([1, 2, 3, 4, 5]), 3).tolist() == []  # nothing repeats
    assert ngram_draft(np.array([5, 1, 5]), 3).tolist() == []  # one-token matches are too weak to draft
    # Past the end of the history, the text found again repeats: a loop of period 1 or 3.
    assert ngram_draft(np.array([4, 4, 4, 4]), 3).tolist() == [4, 4, 4]
    assert ngram_draft(np.array([9, 1, 2, 3, 1, 2, 3, 1]), 5).tolist() == [2, 3, 1, 2, 3]


def rows(*histories: list[int], max_new: int = 20) -> DraftRows:
    return DraftRows.of([RowTokens.of(h[:-1], h[-1], max_new) for h in histories])


def test_each_row_drafts_within_its_budget_unless_it_has_a_grammar():
    d = rows([1, 2, 3, 1, 2], [5, 6, 5, 6], [1, 2, 3, 1, 2], [7, 8, 7, 8], max_new=3)
    d.rows[1] = RowTokens.of([5, 6, 5], 6, 1)  # its only token is generated: no room for another
    plan = d.plan(3, max_rows=4, constrained=[False, False, True, False])  # row 2 has a grammar
    # Rows 0 and 3 may still generate 2 tokens: one draft, and the token after it.
    assert plan.tolist() == [[2, 3, -1, -1], [6, -1, -1, -1], [2, -1, -1, -1], [8, 7, -1, -1]]


def test_no_row_drafts_in_a_large_batch_without_a_match_or_with_too_few_drafting():
    assert rows([1, 2, 1, 2], [3, 4, 3, 4]).plan(2, max_rows=1) is None
    assert rows([1, 2, 3, 4], [5, 6, 7]).plan(2, max_rows=4) is None
    # One row of three drafts: the pass would compute three tokens for every row to try one row's two.
    assert rows([1, 2, 1, 2], [5, 6, 7], [8, 9]).plan(2, max_rows=4) is None
    assert rows([1, 2, 1, 2], [5, 6, 7]).plan(2, max_rows=4) is not None


def test_a_row_whose_drafts_are_rejected_backs_off_longer_each_time():
    d = rows([1, 2, 1, 2])
    skipped = []
    for _ in range(5):
        steps = 0
        while d.plan(2, max_rows=4) is None:
            steps += 1
            d.advance([[]])
        skipped.append(steps)
        d.rows[0] = RowTokens.of([1, 2, 1], 2, 20)  # the same history again: it would draft the same
        d.advance([[9]], drafted=np.array([2]))  # ... and the model rejected it outright
        d.rows[0] = RowTokens.of([1, 2, 1], 2, 20)
    assert skipped == [0, 2, 4, 8, 16]
    d.fails[0] = 10
    d.advance([[9]], drafted=np.array([2]))
    assert d.skip[0] == MAX_SKIP
    d.advance([[1, 2]], drafted=np.array([2]))  # one accepted: it starts over
    assert d.fails[0] == 0


def test_rows_survive_filter_and_concat():
    a, b = rows([1, 2, 1, 2], [3]), rows([4, 5, 4, 5])
    a.skip[1] = 3
    both = DraftRows.concat([a, b]).filter([2, 1])
    assert [r.tokens().tolist() for r in both.rows] == [[4, 5, 4, 5], [3]]
    assert both.skip.tolist() == [0, 3]


def test_a_stale_step_past_the_budget_keeps_nothing():
    row = RowTokens.of([1, 2], 3, 2)
    row.extend([4, 5, 6])
    assert row.tokens().tolist() == [1, 2, 3, 4, 5] and row.room() == -1


def sampler(params: list[SamplingParameters]) -> BatchSampler:
    return BatchSampler(params, [2] * len(params), [[1, 2]] * len(params), V, "cpu")


def decode_one_by_one(params, logits_of):
    """Plain decoding: the reference speculative steps must reproduce token for token."""
    s, out, fed = sampler(params), [[] for _ in params], None
    for j in range(5):
        step = s(logits_of(j))
        fed = step.next_ids.tolist()
        for i, t in enumerate(fed):
            out[i].append((t, round(float(step.logprobs[i]), 5)))
    return out


def test_verify_emits_what_plain_decoding_samples_greedy_or_seeded():
    torch.manual_seed(0)
    table = torch.randn(5, 3, V)  # position j's logits, the same whatever was fed (a model that ignores it)
    params = [SamplingParameters(), SamplingParameters(do_sample=True, seed=7, temperature=0.7),
              SamplingParameters(repetition_penalty=1.3)]
    plain = decode_one_by_one(params, lambda j: table[j])
    # Drafts: row 0 proposes plain decoding's tokens 2 to 4 (all accepted: the pass gives the 5th too),
    # row 1 a wrong second token, row 2 nothing.
    tokens = np.full((3, 4), -1)
    tokens[0, 1:] = [t for t, _ in plain[0][1:4]]
    tokens[1, 1:3] = [plain[1][1][0], (plain[1][2][0] + 1) % V]
    s = sampler(params)
    first = s(table[0])  # the prefill's token
    assert first.next_ids.tolist() == [t for t, _ in (p[0] for p in plain)]
    out, emitted = verify(Backend(torch.device("cpu")), s, table[1:], tokens)  # over fed + 3 drafts
    assert emitted == [[t for t, _ in plain[0][1:5]], [t for t, _ in plain[1][1:3]], [plain[2][1][0]]]
    assert [round(float(x), 5) for x in out.logprobs] == [lp for r, n in ((0, 4), (1, 2), (2, 1))
                                                          for _, lp in plain[r][1:1 + n]]
    assert out.top_ids.shape == (7, 2)
    assert s.steps.tolist() == [5, 3, 2]  # the sampler recorded only the emitted tokens
    assert SpecStats.of(np.array([3, 2, 0]), emitted, 3) == SpecStats(2, 5, 4, [2, 1, 1])


def test_a_pass_cut_to_the_longest_draft_is_verified_as_a_whole_one():
    torch.manual_seed(1)
    table = torch.randn(4, 2, V)
    params = [SamplingParameters(), SamplingParameters()]
    plain = decode_one_by_one(params, lambda j: table[j] if j < 4 else table[3])
    tokens = np.full((2, 4), -1)
    tokens[0, 1] = plain[0][1][0]  # the longest draft: one token, so the pass computes 2 positions
    s = sampler(params)
    s(table[0])
    _, emitted = verify(Backend(torch.device("cpu")), s, table[1:3], tokens)
    assert emitted == [[plain[0][1][0], plain[0][2][0]], [plain[1][1][0]]]
