"""GPTQ and AWQ checkpoints (AutoGPTQ's and AutoAWQ's GEMM on-disk formats, built in the test) served by
`gaudi-serve launch`.

The reference is `transformers` running the same model with the dense weights a dequantization written
from the format's documentation gives (`tests/runtime/prequantized.gptq_reference_weight`, checked
against hand-packed words in tests/unit/test_quant_checkpoint.py), not ours: 16/16 greedy tokens on a
tiny Llama and a tiny Gemma, GPTQ 4 and 8 bit with and without desc_act, symmetric and not, and AWQ
4 bit, 1 and 2 shards.
"""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.family_parity import PROMPTS, served_ids_and_info
from tests.runtime.prequantized import write_awq, write_gptq

pytestmark = pytest.mark.slow

# (family, bits, group size, desc_act, sym, shards); bits 0: AWQ 4-bit
CASES = [("llama", 4, 16, True, False, 2), ("llama", 8, -1, False, True, 2), ("gemma", 4, 32, False, True, 2),
         ("gemma", 8, 16, True, False, 1), ("llama", 0, 16, False, False, 2), ("gemma", 0, 32, False, False, 1)]
NEW_TOKENS = 16


def reference_ids(model_dir, prompts: list[str]) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("family,bits,group,desc_act,sym,shards", CASES,
                         ids=[f"{f}-{f'int{b}' if b else 'awq'}-g{g}{'-desc' if d else ''}{'-sym' if s else '-asym'}"
                              f"-{n}shards" for f, b, g, d, s, n in CASES])
def test_served_greedy_tokens_match_the_reference(family, bits, group, desc_act, sym, shards, tmp_path):
    model = make_tiny_model(tmp_path / "model", family)
    if bits:
        model_dir = write_gptq(model, tmp_path / "dense", bits, group, desc_act, sym)
    else:
        model_dir = write_awq(model, tmp_path / "dense", group)
    prompts = PROMPTS[:3]
    expected = reference_ids(tmp_path / "dense", prompts)
    got, code, info = served_ids_and_info(model_dir, tmp_path / "run", shards, prompts, NEW_TOKENS)
    assert got == expected
    assert all(len(ids) == NEW_TOKENS for ids in got)
    assert code == 200 and info["quantization"].startswith(f"gptq int{bits}" if bits else "awq int4"), info
