"""Tiny random PEFT LoRA adapters for the tests, and transformers + peft as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str | Path, out: str | Path, seed: int, rank: int = 4,
                 targets: list[str] | None = None, alpha: int = 8, rslora: bool = False) -> Path:
    """A LoRA adapter for `model_dir` with random, nonzero A and B (so that it changes the outputs)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                     use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # larger than peft's init, so that greedy tokens differ from the base model's
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return Path(out)


_REFERENCE: dict = {}


def peft_greedy(model_dir, adapter_dir, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers + peft (the adapter applied, not merged): greedy tokens in fp32."""
    import transformers
    from peft import PeftModel

    key = (str(model_dir), str(adapter_dir))
    if key not in _REFERENCE:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir))
        _REFERENCE[key] = (tok, model.eval(), {})
    tok, model, cache = _REFERENCE[key]
    if (prompt, max_new_tokens) not in cache:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
        cache[prompt, max_new_tokens] = out[0, ids.shape[1]:].tolist()
    return cache[prompt, max_new_tokens]
