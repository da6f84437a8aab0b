"""Every model family reports the context it can serve exactly, and the shard interface the runner drives.

A family that runs without a window (its layers all share one: Mistral, Qwen2, Starcoder2, ...) must
cap the served context at a sliding window shorter than its position table: a longer sequence would
otherwise attend further back than the model was trained to, silently. The families whose local
layers attend over their window (Gemma 2/3) serve the whole position table. The router enforces the
cap from `max_position_embeddings`, so each family must report it. Built from the tiny test
configs (no weights: the context and the interface come from the build alone).
"""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.models import SUPPORTED_ARCHITECTURES, CausalLM, TakesImages
from gaudi_runtime.tools.tiny_model import make_config

FAMILY_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_vlm": "Gemma3ForConditionalGeneration",  # served as its text model
    "starcoder2": "Starcoder2ForCausalLM",
    "falcon": "FalconForCausalLM",
    "falcon7b": "FalconForCausalLM",
    "starcoder": "GPTBigCodeForCausalLM",
    "llava": "LlavaNextForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
POSITIONS = 4096  # the tiny configs' max_position_embeddings
WINDOWED = {"gemma2", "gemma3", "gemma3_vlm"}  # local layers attend over the window: no cap
WINDOW = 64


def config(family: str, **text_overrides) -> dict:
    """config.json of the tiny model of `family`, with `text_overrides` in its language model's part."""
    cfg = make_config(family, vocab_size=128).to_dict()
    cfg["architectures"] = [FAMILY_ARCHITECTURES[family]]
    cfg.get("text_config", cfg).update(text_overrides)
    return cfg


def build(cfg: dict):
    arch = cfg["architectures"][0]
    cls = SUPPORTED_ARCHITECTURES[arch]
    return cls(cls.config_class.from_dict(cfg, arch), TPContext(), torch.float32, "cpu")


def test_every_supported_architecture_is_covered():
    assert set(FAMILY_ARCHITECTURES.values()) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("family", FAMILY_ARCHITECTURES)
def test_a_sliding_window_caps_the_context(family):
    model = build(config(family, sliding_window=WINDOW, use_sliding_window=True))
    assert model.max_position_embeddings == (POSITIONS if family in WINDOWED else WINDOW)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_families_attend_over_the_window_on_their_local_layers_only(family):
    cfg = config(family, sliding_window=WINDOW)
    model = build(cfg)
    windows = [m.window for m in model.modules() if type(m).__name__ == "Attention"]
    types = cfg.get("text_config", cfg)["layer_types"]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in types]
    assert WINDOW in windows and None in windows


@pytest.mark.parametrize("family", FAMILY_ARCHITECTURES)
def test_without_a_window_the_context_is_the_position_table(family):
    model = build(config(family, sliding_window=None))
    assert model.max_position_embeddings == (1024 if family == "starcoder" else POSITIONS)  # GPTBigCode: n_positions


def test_a_window_longer_than_the_position_table_changes_nothing():
    assert build(config("mistral", sliding_window=2 * POSITIONS)).max_position_embeddings == POSITIONS


def test_qwen2_declares_a_window_it_uses_only_when_told():
    """Qwen2 configs carry `sliding_window` always; attention is windowed only with `use_sliding_window`."""
    assert build(config("qwen2", sliding_window=WINDOW, use_sliding_window=False)).max_position_embeddings == POSITIONS


@pytest.mark.parametrize("family", FAMILY_ARCHITECTURES)
def test_every_family_gives_the_runner_its_interface(family):
    cfg = config(family)
    model = build(cfg)
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    assert isinstance(model, CausalLM)
    assert model.takes_images == isinstance(model, TakesImages) == (family == "llava")
    text = cfg.get("text_config", cfg)
    layers = text.get("num_hidden_layers", text.get("n_layer"))
    assert model.num_layers == layers and model.vocab_size == 128
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert model.num_heads % model.num_kv_heads == 0
    hidden = model(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], None, _prefill_meta(3))
    assert hidden.shape == (1, 3, model.hidden_size)
    assert model.compute_logits(hidden[0]).shape == (3, 128)


@pytest.mark.parametrize("family", FAMILY_ARCHITECTURES)
def test_a_tied_head_is_the_embedding_and_an_untied_one_is_its_own(family):
    for tied in (True, False):
        model = build(config(family, tie_word_embeddings=tied))
        head = next(m for n, m in model.named_modules() if n.endswith("lm_head"))
        embedding_weights = {p.data_ptr() for n, p in model.named_parameters() if n != "lm_head.weight"
                             and not n.endswith(".lm_head.weight")}
        assert (head.weight.data_ptr() in embedding_weights) == tied


def _prefill_meta(n: int):
    from gaudi_runtime.layers.attention import AttentionMetadata

    return AttentionMetadata(is_prefill=True, slots=torch.zeros(1, n, dtype=torch.long))
