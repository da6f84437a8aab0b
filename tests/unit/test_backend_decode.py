"""The router decodes with the `tokenizers` backend where that gives transformers' text exactly.

Several tokenizer families, built here without the hub: the byte-level BPE of the tiny models
(every family the tests make), with an image token and an added token; a SentencePiece-style
Unigram with byte fallback and a decoder that strips the leading space; a byte-level BPE that asks
for clean-up of tokenization spaces (GPT-2's config: transformers skips it for BPE), and one that
forces it; a WordPiece whose decode cleans up (BERT's); and a class with a decode of its own. For each, every window the incremental detokenizer decodes, the
streamed pieces and the stop-sequence checks are the same as through `transformers`' decode.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gaudi_runtime.router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.tools.tiny_model import IMAGE_TOKEN, _corpus, train_tokenizer

TEXTS = [
    "hello world 東京 数据 模型 😀 🚀 ñandú café naïve über",
    "🎉 日本語 Ωμέγα 🦀 東京🎉数据 👩‍👩‍👧",  # outside the corpora: one token per byte
    "Hello , world . It 's fine , isn't it ? Yes ! I 'm sure they 're done , we 've seen .",
    "  two  spaces, a\ttab and\nnew lines \"quoted\" back\\slash",
]
STOPS = ["東京", "it ?", "\n", "🦀", "done"]


class TransformersDecode:
    """The reference: decoding through transformers, as the router did before."""

    def __init__(self, hf):
        self.hf = hf

    def decode(self, ids, skip_special_tokens=False):
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


class ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class whose decode changes the backend's text: the router must keep using it."""

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


def _byte_level(cleanup: bool = False, forced: bool = False) -> PreTrainedTokenizerFast:
    hf = train_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    hf.add_tokens([AddedToken("<tool_call>", normalized=False)])
    hf.clean_up_tokenization_spaces = cleanup
    # transformers skips the clean-up for BPE unless told this (then transformers' decode cleans up).
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = forced
    return hf


def _unigram_byte_fallback() -> PreTrainedTokenizerFast:
    words = sorted({w for line in _corpus(200, 1) for w in line.split()})
    pieces = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
              + [("▁", -3.0)] + [(c, -6.0) for c in "abcdefghijklmnopqrstuvwxyzHIY.,!?'\"\\"]
              + [("▁" + w, -2.0) for w in words])
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def _wordpiece_cleanup() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_corpus(500, 2) + TEXTS, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   eos_token="[SEP]", clean_up_tokenization_spaces=True)


def _shouting() -> PreTrainedTokenizerFast:
    return ShoutingTokenizer(tokenizer_object=train_tokenizer().backend_tokenizer, eos_token="</s>")


# name -> (builder, whether the backend's decode is exact for it, so the router uses it)
FAMILIES = {
    "byte-level-bpe": (_byte_level, True),
    "byte-level-bpe-cleanup-config": (lambda: _byte_level(cleanup=True), True),
    "byte-level-bpe-forced-cleanup": (lambda: _byte_level(cleanup=True, forced=True), False),
    "unigram-byte-fallback": (_unigram_byte_fallback, True),
    "wordpiece-cleanup": (_wordpiece_cleanup, False),
    "own-decode": (_shouting, False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    build, backend_exact = FAMILIES[request.param]
    hf = build()
    return hf, RouterTokenizer(hf), backend_exact


def _id_streams(hf) -> list[list[int]]:
    """Encoded texts (with an EOS and special ids among them), and random ids: byte fragments."""
    rng = random.Random(0)
    specials = list(hf.all_special_ids)
    streams = []
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        streams.append(ids)
    streams += [[rng.randrange(len(hf)) for _ in range(120)] for _ in range(3)]
    return streams


def test_the_backend_decode_is_used_where_exact(family):
    hf, tok, backend_exact = family
    assert (tok._decode != hf.decode) == backend_exact  # the speed-up is not silently lost


def test_every_window_decodes_as_transformers_does(family):
    hf, tok, _ = family
    for ids in _id_streams(hf):
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        for start in range(len(ids)):
            for end in range(start + 1, min(start + 8, len(ids)) + 1):
                assert tok.decode(ids[start:end]) == hf.decode(ids[start:end]), ids[start:end]


def test_streamed_pieces_and_stops_are_those_of_transformers(family):
    hf, tok, _ = family
    reference = TransformersDecode(hf)
    for ids in _id_streams(hf):
        prompt = ids[:4]
        ours, theirs = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(reference, prompt)
        stop_ours, stop_theirs = StopSequenceMatcher(STOPS), StopSequenceMatcher(STOPS)
        for i in ids[4:]:
            assert ours.add(i) == theirs.add(i)
            assert stop_ours.check(ours.text) == stop_theirs.check(theirs.text)
        assert ours.flush() == theirs.flush()
        assert ours.text == theirs.text and stop_ours.matched == stop_theirs.matched
