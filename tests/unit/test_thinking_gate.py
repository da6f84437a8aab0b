"""A reasoning model's grammar on the shard: its mask is off while the model thinks and on from the
token after `</think>` (shard/grammar.py ThinkingGate), with xgrammar's real matchers over a tiny
byte-level vocabulary that has `<think>` and `</think>` as single tokens."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from gaudi_runtime.shard.grammar import GrammarCache, GrammarRows, ThinkingGate, allowed_tokens
from gaudi_runtime.shard.sampling import BatchSampler, SamplingParameters

CPU = torch.device("cpu")
REGEX = "(yes|no)-[0-9]{2}"


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    from gaudi_runtime.tools.tiny_model import train_tokenizer

    tok = train_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    cache = GrammarCache(str(d), len(tok), [1])
    cache.tokenizer = tok
    cache.think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    return cache


_grammar_ids = itertools.count(1)


def _matcher(cache, kind: str, value: str):
    """A matcher of a grammar compiled under a fresh id, as a prefill gets one."""
    grammar_id = next(_grammar_ids)
    cache.compile(grammar_id, kind, value)
    return cache.matcher(grammar_id)


def _allowed(rows: GrammarRows, vocab: int) -> list[set[int]]:
    mask = allowed_tokens(rows.fill(len(rows)), vocab)
    return [set(r.nonzero().flatten().tolist()) for r in mask]


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


PREFIX = re.compile(r"y(e(s(-[0-9]{0,2})?)?)?|n(o(-[0-9]{0,2})?)?")  # where the regex's answers may start


def test_the_mask_is_off_while_thinking_and_on_after_the_end_token(grammars):
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    start, end = grammars.think
    gate = ThinkingGate(_matcher(grammars, "regex", REGEX), start, end, True)
    rows = GrammarRows.of(grammars, [gate, _matcher(grammars, "regex", REGEX)])
    plain = _allowed(rows, vocab)[1]
    assert 0 < len(plain) < vocab // 4, "the same grammar without a gate masks from the first token"
    for t in _ids(tok, "hmm, {not json} no-12") + [start]:
        assert _allowed(rows, vocab)[0] == set(range(vocab)), "nothing is masked while the model thinks"
        rows.accept([t, next(iter(plain))])
        plain = _allowed(rows, vocab)[1]
    rows = GrammarRows.of(grammars, [gate])
    rows.accept([end])  # the thinking ends: the grammar applies from the next token
    first = _allowed(rows, vocab)[0]
    assert first and all(PREFIX.fullmatch(tok.decode([t])) for t in first), [tok.decode([t]) for t in first]
    assert end not in first and start not in first
    for t in _ids(tok, "no-42"):
        assert t in _allowed(rows, vocab)[0]
        rows.accept([t])
    assert _allowed(rows, vocab)[0] == {1}, "then only EOS, as any complete grammar"
    rows.accept([1])
    assert gate.is_terminated()


def test_a_first_token_that_is_not_the_start_token_is_the_answer(grammars):
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    start, end = grammars.think
    gate = ThinkingGate(_matcher(grammars, "regex", REGEX), start, end, False)
    rows = GrammarRows.of(grammars, [gate])
    first = _allowed(rows, vocab)[0]
    assert start in first and len(first) < vocab // 4, "the grammar's first tokens, and the one opening a thought"
    rows.accept([_ids(tok, "yes")[0]])
    assert start not in _allowed(rows, vocab)[0], "past the first token, the grammar alone decides"


def test_an_output_that_opens_its_thinking_is_free_until_it_closes_it(grammars):
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    start, end = grammars.think
    gate = ThinkingGate(_matcher(grammars, "json", json.dumps({"type": "object"})), start, end, False)
    rows = GrammarRows.of(grammars, [gate])
    rows.accept([start])
    for t in _ids(tok, "free text"):
        assert _allowed(rows, vocab)[0] == set(range(vocab))
        rows.accept([t])
    rows.accept([end])
    assert _allowed(rows, vocab)[0] <= {t for t in range(vocab) if tok.decode([t]).startswith("{")}


def test_sampled_rows_think_freely_then_answer_in_the_grammar(grammars):
    """Sampling on random logits as the runner does: whatever a row thinks, once it is made to close
    its thinking (the test forces `</think>` after a few steps) the rest follows the regex."""
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    start, end = grammars.think
    gates = [ThinkingGate(_matcher(grammars, "regex", REGEX), start, end, True) for _ in range(4)]
    sampler = BatchSampler([SamplingParameters(do_sample=True, seed=s) for s in range(4)], [0] * 4, [[]] * 4,
                           vocab, CPU, GrammarRows.of(grammars, gates))
    out = [[] for _ in range(4)]
    g = torch.Generator().manual_seed(0)
    for step in range(16):
        ids = sampler(torch.randn(4, vocab, generator=g) * 3, sampler.grammar.fill(4)).next_ids.tolist()
        if step == 5:
            ids = [end] * 4
        sampler.accept(ids)
        for row, t in zip(out, ids, strict=True):
            row.append(t)
    for row in out:
        thought, answer = row[:5], row[6:]
        assert not re.fullmatch(REGEX, tok.decode(thought))
        answer = answer[:answer.index(1)] if 1 in answer else answer
        assert re.fullmatch(REGEX, tok.decode(answer)), tok.decode(answer)


def test_a_forced_deepseek_call_follows_the_thinking(grammars):
    """tool_choice required on a DeepSeek-R1: free thinking, then only a call in DeepSeek-V3's format."""
    from gaudi_runtime.router.tool_calls import call_grammar, parse

    tok, vocab = grammars.tokenizer, grammars.vocab_size
    start, end = grammars.think
    spec = call_grammar("deepseek_v3", [("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc"]}},
                                                       "required": ["zone"]})], several=False)
    gate = ThinkingGate(_matcher(grammars, spec.kind, spec.value), start, end, True)
    rows = GrammarRows.of(grammars, [gate])
    for t in _ids(tok, "no call yet") + [end]:
        assert _allowed(rows, vocab)[0] == set(range(vocab))
        rows.accept([t])
    answer = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
              '{"zone": "utc"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert _ids(tok, "Sure")[0] not in _allowed(rows, vocab)[0]
    for t in _ids(tok, answer):
        assert t in _allowed(rows, vocab)[0], tok.decode([t])
        rows.accept([t])
    assert _allowed(rows, vocab)[0] == {1}
    (call,) = parse("deepseek_v3", answer, final=True).calls
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "utc"})
