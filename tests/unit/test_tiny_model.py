"""`gaudi-serve tiny-model`: the overhead model bench/compare_vllm.sh serves with both engines."""

from __future__ import annotations

import json

from gaudi_runtime.tools.tiny_model import main, train_tokenizer


def test_overhead_model_takes_another_models_tokenizer_and_a_head_size_vllm_accepts(tmp_path, capsys):
    donor = tmp_path / "donor"
    train_tokenizer(vocab_size=600).save_pretrained(donor)
    main([str(tmp_path / "overhead"), "--size", "overhead", "--dtype", "bfloat16", "--tokenizer-from", str(donor)])
    cfg = json.loads((tmp_path / "overhead" / "config.json").read_text())
    assert cfg["hidden_size"] <= 128 and cfg["num_hidden_layers"] <= 4
    assert cfg["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"] == 32  # vLLM's CPU attention refuses 16
    donor_vocab = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((tmp_path / "overhead" / "tokenizer.json").read_text())["model"]["vocab"] == donor_vocab
    assert cfg["vocab_size"] == len(donor_vocab)


def test_memory_floor_counts_what_a_decode_step_reads(tmp_path):
    """Every weight of the decoder and the head, once; the input embedding only when the head is tied to it."""
    import torch

    from gaudi_runtime.bench.memory_floor import weight_bytes_per_step
    from gaudi_runtime.models.registry import load_model

    main([str(tmp_path / "m"), "--dtype", "float32"])
    model = load_model(str(tmp_path / "m"), torch.float32, torch.device("cpu"))
    cfg = model.config
    embedding = cfg.vocab_size * cfg.hidden_size * 4
    every = sum(p.numel() * 4 for p in model.parameters())  # a tied head's tensor appears once here
    expected = every if cfg.tie_word_embeddings else every - embedding
    assert weight_bytes_per_step(model) == expected


def test_the_family_models_take_the_reference_shape_and_the_moe_its_active_width():
    """bench/compare_vllm.sh's families workload compares Qwen3 with the Llama of the same shape, and a
    Qwen3-MoE whose routed experts per token hold as many weights as that Llama's MLP."""
    from gaudi_runtime.bench.family_models import family_config

    like = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    dense, moe = family_config("qwen3", like), family_config("qwen3_moe", like)
    assert (dense.head_dim, dense.intermediate_size, dense.attention_bias) == (64, 1536, False)
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == like["intermediate_size"]
    assert moe.num_experts == 64 and moe.mlp_only_layers == [] and moe.num_hidden_layers == 8
