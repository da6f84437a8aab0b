"""Gemma 2/3 config.json files as published (transformers 4's layout: `rope_theta`, `rope_local_base_freq`,
`rope_scaling`, `sliding_window_pattern`, no `layer_types`) and as transformers 5 writes them read to the
same model; the final logits are soft-capped; a malformed `layer_types` stops the start naming it."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.models.gemma2 import Gemma2Config, Gemma2ForCausalLM
from gaudi_runtime.models.gemma3 import Gemma3Config

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}


def test_gemma2_published_config_alternates_local_and_global_layers():
    cfg = Gemma2Config.from_dict({**BASE, "num_hidden_layers": 4, "sliding_window": 4096,
                                  "query_pre_attn_scalar": 224}, "Gemma2ForCausalLM")
    assert cfg.sliding_layers == (True, False, True, False)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)  # transformers' defaults
    assert cfg.query_pre_attn_scalar == 224 and cfg.context_length == cfg.max_position_embeddings


def test_gemma3_published_config_reads_as_transformers_5_writes_it():
    old = {**BASE, "num_hidden_layers": 12, "sliding_window": 512, "sliding_window_pattern": 6,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "attn_logit_softcapping": 50.0}
    new = {**BASE, "num_hidden_layers": 12, "sliding_window": 512,
           "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    a, b = (Gemma3Config.from_dict(c, "Gemma3ForCausalLM") for c in (old, new))
    assert a.sliding_layers == b.sliding_layers == ((True,) * 5 + (False,)) * 2
    assert a.local_rope_theta == b.local_rope_theta == 10_000.0
    assert a.rope_theta == b.rope_theta == 1e6 and a.rope_scaling["factor"] == b.rope_scaling["factor"] == 8.0
    assert a.attn_softcap is None  # transformers' Gemma 3 does not soft-cap attention
    bare = Gemma3Config.from_dict({**BASE, "num_hidden_layers": 2}, "Gemma3ForCausalLM")
    assert bare.rope_theta == 1e6 and bare.local_rope_theta == 1e4  # transformers' Gemma 3 defaults


def test_a_malformed_layer_types_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="layer_types must be 2 entries"):
        Gemma2Config.from_dict({**BASE, "num_hidden_layers": 2, "layer_types": ["sliding_attention"]},
                               "Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="layer_types"):
        Gemma2Config.from_dict({**BASE, "num_hidden_layers": 1, "layer_types": ["chunked_attention"]},
                               "Gemma2ForCausalLM")


def test_final_logits_are_soft_capped():
    cfg = Gemma2Config.from_dict({**BASE, "num_hidden_layers": 2, "final_logit_softcapping": 3.0},
                                 "Gemma2ForCausalLM")
    model = Gemma2ForCausalLM(cfg, TPContext(), torch.float32, "cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 1.0)
    hidden = torch.randn(4, 32) * 0.5
    logits = model.compute_logits(hidden)
    raw = hidden @ model.lm_head.weight.T
    torch.testing.assert_close(logits, torch.tanh(raw / 3.0) * 3.0, atol=1e-5, rtol=1e-5)
    assert raw.abs().max() > 3.0 and logits.abs().max() <= 3.0


def test_rope_scaling_override_keeps_the_local_layers_base():
    """--rope-scaling replaces the global layers' scaling; the local layers keep their own base."""
    from gaudi_runtime.models.registry import override_rope

    cfg = {**BASE, "num_hidden_layers": 2,
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}
    out = Gemma3Config.from_dict(override_rope(cfg, "linear", 4.0), "Gemma3ForCausalLM")
    assert out.local_rope_theta == 500.0 and out.rope_theta == 1e6 and out.rope_scaling["factor"] == 4.0
