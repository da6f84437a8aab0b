"""The router tokenizes as `transformers.AutoTokenizer` does, in a process that never imports torch.

A prompt tokenized otherwise than the model's own tokenizer (the one transformers and vLLM load)
gives other greedy outputs. The router's side runs in a subprocess started as the router is
(`router.main.load_tokenizer`), over every family's tokenizer that the tiny-model tool writes,
each also with a vocabulary that merges digits, where the choice of class shows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi_runtime.tools.tiny_model import FAMILIES, save_tokenizer

TEXTS = [
    # digits: a model type's pre-tokenizer may split them one by one where the generic one merges
    "item59", "item59 costs 1234567.89 on 2026-11-27", "x = 3.14159e-10",
    # whitespace
    "  two leading spaces", "tabs\tand\nnew lines\r\n", "trailing   ", "a  b   c    d", "\n\n\n", "",
    # unicode: composed and decomposed accents (a normalizer shows), CJK, emoji with a joiner
    "café naïve über ñandú", "cafe\u0301 nai\u0308ve", "東京 数据 模型", "😀 🚀 👩‍💻", "Ω≈ç√∫",
    # special tokens, and text that looks like one
    "<s>hello</s>", "</s></s>", "<unk> and <image> and <|endoftext|>", "< s>hello</ s>",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "item59 café 😀"}]
GENERIC_QWEN2 = "qwen2-digits-generic-class"
DIRS = [*FAMILIES, *(f"{f}-digits" for f in FAMILIES), GENERIC_QWEN2]


def _digit_merging_tokenizer(out: Path) -> None:
    """A byte-level BPE trained on text with numbers: its vocabulary has multi-digit tokens ("59",
    "item59"), as GPT-2-style vocabularies do, which a digit-splitting pre-tokenizer never uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"item{n} costs {n * 7}.{n % 10} on 2026-11-{n % 28 + 1:02d}, café 東京 😀" for n in range(100)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokenizers")
    _digit_merging_tokenizer(root / "digits-base")
    for family in FAMILIES:
        save_tokenizer(root / family, family)
        save_tokenizer(root / f"{family}-digits", family, tokenizer_from=root / "digits-base")
    # The case: a Qwen2 model whose tokenizer_config.json names the generic class.
    shutil.copytree(root / "qwen2-digits", root / GENERIC_QWEN2)
    config = root / GENERIC_QWEN2 / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return root


ROUTER_SIDE = """
import json, sys
from gaudi_runtime.config import Config
from gaudi_runtime.router.main import load_tokenizer
root, names, texts, messages = json.loads(sys.stdin.read())
out = {}
for name in names:
    tok = load_tokenizer(Config.of(model_id="m").model, f"{root}/{name}")
    encoded = {t: [tok.encode(t), tok.encode(t, add_special_tokens=False)] for t in texts}
    out[name] = {
        "class": type(tok.hf).__name__,
        "encoded": encoded,
        "offsets": {t: [list(x) for x in tok.encode_with_offsets(t)] for t in texts},
        "decoded": {t: [tok.decode(ids), tok.decode(ids, skip_special_tokens=True)]
                    for t, (ids, _) in encoded.items()},
        "pieces": {t: [tok.decode([i]) for i in ids] for t, (_, ids) in encoded.items()},
        "special_ids": sorted(tok.special_ids),
        "bos": tok.hf.bos_token_id, "eos": tok.hf.eos_token_id, "size": len(tok.hf),
        "chat": tok.apply_chat_template(messages) if tok.chat_template else None,
    }
torch = [m for m, module in sys.modules.items() if m.split(".")[0] == "torch" and module is not None]
print(json.dumps({"tokenizers": out, "torch_modules": torch}))
"""


@pytest.fixture(scope="module")
def router_side(model_dirs) -> dict:
    """What the router's tokenizer gives for every directory, from a process started as the router is."""
    job = json.dumps([str(model_dirs), DIRS, TEXTS, MESSAGES])
    done = subprocess.run([sys.executable, "-c", ROUTER_SIDE], input=job, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _transformers_side(path: Path) -> dict:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(path)
    encoded = {t: [auto.encode(t), auto.encode(t, add_special_tokens=False)] for t in TEXTS}

    def offsets(t: str) -> list[list[int]]:
        enc = auto(t, return_offsets_mapping=True)
        return [[i, s, e] for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]

    chat = auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) if auto.chat_template else None
    return {
        "class": type(auto).__name__,
        "encoded": encoded,
        "offsets": {t: offsets(t) for t in TEXTS},
        "decoded": {t: [auto.decode(ids), auto.decode(ids, skip_special_tokens=True)]
                    for t, (ids, _) in encoded.items()},
        "pieces": {t: [auto.decode([i]) for i in ids] for t, (_, ids) in encoded.items()},
        "special_ids": sorted(auto.all_special_ids),
        "bos": auto.bos_token_id, "eos": auto.eos_token_id, "size": len(auto),
        "chat": chat,
    }


@pytest.mark.parametrize("name", DIRS)
def test_the_router_tokenizes_and_decodes_as_auto_tokenizer_does(router_side, model_dirs, name):
    router, auto = router_side["tokenizers"][name], _transformers_side(model_dirs / name)
    for key in auto:
        assert router[key] == auto[key], f"{name}: the router's {key} differs from AutoTokenizer's"


def test_a_qwen2_model_whose_config_names_the_generic_class_splits_digits(router_side, model_dirs):
    """The issue's case: the vocabulary merges digits, but Qwen2's tokenizer (what AutoTokenizer
    loads for the model type) puts every digit in a token of its own: `item59` ends in `5`, `9`."""
    vocab = json.loads((model_dirs / GENERIC_QWEN2 / "tokenizer.json").read_text())["model"]["vocab"]
    assert "59" in vocab  # what the generic class would have made one token
    assert router_side["tokenizers"][GENERIC_QWEN2]["pieces"]["item59"][-2:] == ["5", "9"]


def test_the_router_process_never_imports_torch(router_side):
    assert router_side["torch_modules"] == []
