"""Random models of the newer families in the reference model's shape, for speed comparisons:

    python -m gaudi_runtime.bench.family_models OUT --family qwen3_moe --like MODEL_DIR

`--like` is a Llama directory (bench/compare_vllm.sh's `small` model): its tokenizer, hidden size,
layers and heads are kept, so that tokens per second compare across families and with vLLM.

- qwen3: Llama's shape (head size hidden / heads, no attention bias) plus Qwen3's q/k norms: what a
  Qwen3 dense model adds to a Llama of the same shape.
- qwen3_moe: every layer sparse, 64 experts of which 8 are routed per token, each expert's width
  3/8 of the hidden size (Qwen3-30B-A3B's ratios: 128 experts, top 8, 768 wide on 2048), so a token's
  active MLP weights equal the Llama's dense MLP at the small shape (8 x 3 x 512 x 192 = 3 x 512 x 1536).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = ("qwen3", "qwen3_moe")


def family_config(family: str, like: dict):
    """A transformers config of `family` in the shape of the Llama config `like` (its config.json)."""
    import transformers

    shape = {k: like[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id")}
    shape["head_dim"] = like["hidden_size"] // like["num_attention_heads"]
    common = dict(**shape, attention_bias=False, use_sliding_window=False, tie_word_embeddings=False,
                  initializer_range=0.1, torch_dtype="bfloat16")
    if family == "qwen3":
        return transformers.Qwen3Config(**common, intermediate_size=like["intermediate_size"])
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=like["intermediate_size"], num_experts=64,
                                           num_experts_per_tok=8, moe_intermediate_size=like["hidden_size"] * 3 // 8,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def write_model(out: str | Path, family: str, like: str | Path, seed: int = 0) -> Path:
    """Random bfloat16 weights of `family_config(family, like)` and `like`'s tokenizer, into `out`."""
    import torch
    import transformers

    out, like = Path(out), Path(like)
    cfg = family_config(family, json.loads((like / "config.json").read_text()))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(like).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.family_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--like", required=True, metavar="MODEL_DIR", help="the Llama model whose shape and tokenizer to take")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write_model(a.out, a.family, a.like, a.seed))


if __name__ == "__main__":
    main()
