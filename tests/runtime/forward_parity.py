"""One prefill pass of our model vs transformers on the same random weights, in process (no server).

For config variants of a family that the served tests do not cover: cheap enough to try many.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_model(config, out: Path, seed: int = 0) -> Path:
    """Save a random-weight transformers model for ``config`` (1-D weights randomized too) to ``out``."""
    import transformers

    from gaudi_runtime.tools.tiny_model import randomize_vectors

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    randomize_vectors(out, seed)
    return out


def assert_prefill_logits_match(model_dir: Path, seq_len: int = 13, batch: int = 2, seed: int = 0) -> None:
    import transformers

    from gaudi_runtime.layers.attention import AttentionMetadata
    from gaudi_runtime.models import load_model

    ours = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq_len).expand(batch, seq_len)
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(batch, seq_len, dtype=torch.long))
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, positions, None, meta))
        want = ref(ids).logits.float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
