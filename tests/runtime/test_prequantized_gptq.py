"""GPTQ and AWQ checkpoints (AutoGPTQ's and AutoAWQ's GEMM on-disk formats, built in the test) served by
`gaudi-serve launch`.

The reference is `gptqmodel`'s own dequantization of each checkpoint as written on disk (its GPTQ
`TorchLinear`, its AWQ GEMM unpacking: tests/runtime/gptqmodel_reference.py), run dense by `transformers`
in float32, never ours: 16/16 greedy tokens on a tiny Llama and a tiny Gemma, GPTQ 4 and 8 bit with and
without desc_act, symmetric and not, and AWQ 4 bit, 1 and 2 shards. The checkpoints are written by the
test in the libraries' exact on-disk layout (round-to-nearest integers; GPTQ's error correction only
changes which integers are stored): quantizing with the library itself costs about a minute a model.
"""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.family_parity import PROMPTS, served_ids_and_info
from tests.runtime.prequantized import gptqmodel_dense_copies, write_awq, write_gptq

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


IDS = [f"{f}-{f'int{b}' if b else 'awq'}-g{g}{'-desc' if d else ''}{'-sym' if s else '-asym'}-{n}shards"
       for f, b, g, d, s, n in CASES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Every case's checkpoint and its reference copy, dequantized by gptqmodel in one process."""
    root = tmp_path_factory.mktemp("prequantized")
    found = {}
    for case_id, (family, bits, group, desc_act, sym, _) in zip(IDS, CASES):
        model = make_tiny_model(root / case_id / "model", family)
        found[case_id] = (write_gptq(model, bits, group, desc_act, sym) if bits else write_awq(model, group),
                          root / case_id / "reference")
    gptqmodel_dense_copies(list(found.values()))
    return found


@pytest.mark.parametrize("family,bits,group,desc_act,sym,shards", CASES, ids=IDS)
def test_served_greedy_tokens_match_the_reference(family, bits, group, desc_act, sym, shards, checkpoints,
                                                   request, tmp_path):
    model_dir, reference_dir = checkpoints[request.node.callspec.id]
    prompts = PROMPTS[:3]
    expected = reference_ids(reference_dir, prompts)
    got, code, info = served_ids_and_info(model_dir, tmp_path / "run", shards, prompts, NEW_TOKENS)
    assert got == expected
    assert all(len(ids) == NEW_TOKENS for ids in got)
    assert code == 200 and info["quantization"].startswith(f"gptq int{bits}" if bits else "awq int4"), info
