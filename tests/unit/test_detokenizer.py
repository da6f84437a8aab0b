"""Incremental detokenization and stop sequences on the tiny model's tokenizer."""

from __future__ import annotations

import pytest

from gaudi_runtime.router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from gaudi_runtime.router.tokenizer import RouterTokenizer

TEXTS = [
    "東京 数据 😀",
    "hello world 東京 数据 模型 😀 🚀 ñandú café naïve über",
    "😀😀😀 🚀🚀",
    "the gaudi card serve request stream",
    "🎉 日本語 Ωμέγα 🦀 東京🎉数据",  # characters outside the training corpus: one token per byte
]


@pytest.fixture(scope="module")
def tok() -> RouterTokenizer:
    from gaudi_runtime.tools.tiny_model import train_tokenizer

    return RouterTokenizer(train_tokenizer())


def stream(tok, ids, prompt_ids=None):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return d, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_whole_characters_and_add_up(tok, text):
    ids = tok.encode(text)
    d, pieces = stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids) == text
    assert d.text == text
    assert d.token_ids == ids


def test_multibyte_characters_span_several_tokens(tok):
    # The test above is only meaningful if some character needs more than one token.
    ids = tok.encode("🎉 日本語 東京")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    _, pieces = stream(tok, ids)
    assert "" in pieces  # some token completed no character: nothing emitted for it


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("hello world 東")
    ids = tok.encode(" 京 数据 😀 🎉")
    _, pieces = stream(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(ids)


def test_special_tokens(tok):
    ids = tok.encode("hello world") + [tok.eos_token_id]
    _, pieces = stream(tok, ids)
    assert "".join(pieces) == "hello world</s>"


def test_flush_emits_an_incomplete_character(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1
    d, pieces = stream(tok, ids[:-1])
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == tok.decode(ids[:-1])  # at the end, whatever is held is flushed


def test_skip_tokenizer_mode_decodes_ids():
    t = RouterTokenizer(None, skip_tokenizer=True, eos_token_ids=[2])
    assert t.encode("5, 6,7") == [5, 6, 7]
    d, pieces = stream(t, [5, 6, 7])
    assert "".join(pieces) == "5,6,7"


def test_stop_sequence_at_end_and_inside():
    m = StopSequenceMatcher(["###", "\nUser:"])
    assert not m.check("hello")
    assert not m.check("hello #")
    assert not m.check("hello ##")
    assert m.check("hello ###")
    assert m.matched == "###"
    # A stop sequence completed in the middle of a token's text matches too.
    m = StopSequenceMatcher(["stop"])
    assert not m.check("a st")
    assert m.check("a stop and more")
    assert StopSequenceMatcher([]).check("anything") is False
    assert StopSequenceMatcher([""]).check("anything") is False


def test_stop_sequence_split_across_many_checks():
    m = StopSequenceMatcher(["abcdef"])
    text = ""
    hits = []
    for ch in "xxabcdefyy":
        text += ch
        hits.append(m.check(text))
    assert hits.index(True) == len("xxabcdef") - 1
