"""Write a tiny random-weight model and a trained tokenizer, for demos and tests.

No hub access: the tokenizer is trained on text generated here, the weights
are random (seeded). `gaudi-serve tiny-model OUT --family llama`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# The families whose models call tools get a template in their own format (shortened from the
# originals, with the same tool rendering and call syntax), so that tool calling can be served and
# tested: Llama 3.1's JSON, Mistral's [TOOL_CALLS], Qwen2.5's (Hermes) <tool_call>.
LLAMA31_TEMPLATE = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\n
{%- if tools is not none %}Environment: ipython\n{% endif %}Cutting Knowledge Date: December 2023<|eot_id|>
{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>\n\n
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n
{%- for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.role == 'system' %}[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [
{%- for tc in message.tool_calls %}{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}, "id": {{ (tc.id or '') | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": {{ (message.tool_call_id or '') | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

QWEN25_TEMPLATE = """{%- if tools %}<|im_start|>system\n
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}
{%- for tc in message.tool_calls or [] %}\n<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n
{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n
{%- elif message.role != 'system' or loop.index0 > 0 %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"""

# Qwen3: Qwen2.5's hermes tools, plus thinking. The answer starts with a <think> section unless the request
# says `enable_thinking: false` (then an empty one is written into the prompt); past assistant turns keep
# only what follows their </think>.
QWEN3_TEMPLATE = QWEN25_TEMPLATE.replace(
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}",
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{{ (message.content or '').split('</think>')[-1].lstrip('\\n') }}",
).replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
)
THINK_TOKENS = ["<think>", "</think>"]

CHAT_TEMPLATES = {"llama31": LLAMA31_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "qwen2": QWEN25_TEMPLATE,
                  "qwen3": QWEN3_TEMPLATE, "qwen3_moe": QWEN3_TEMPLATE}
# Families whose tokenizer has <think> and </think> as tokens of their own (not special: they stay in
# the decoded text, where a reasoning parser finds them).
THINKING_FAMILIES = {"qwen3", "qwen3_moe"}

_WORDS = (
    "the a deep learning model is what how why when gaudi card shard router token batch cache "
    "serve request stream answer question data train weight layer attention head vector "
    "kubernetes pod operator cluster node graph warmup bucket prefill decode hello world "
    "café naïve über 東京 数据 模型 😀 🚀 ñandú"
).split()

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
    # Rows wide enough (several of the kernels' steps per dot product) that a product's blocking, which depends
    # on the batch, changes a row's bits: the batch-invariant mode's test needs the default mode to differ.
    "wide": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4),
    # A forward pass that costs almost nothing, so that tokens per second measure the engine around
    # it (bench/compare_vllm.sh's overhead workload). Head size 32: vLLM's CPU attention refuses 16.
    "overhead": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2),
}


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def train_tokenizer(vocab_size: int = 512, seed: int = 0, chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


def _llama(common, shape):
    import transformers

    return transformers.LlamaConfig(**common, **shape, tie_word_embeddings=False)


def _llama31(common, shape):
    import transformers

    return transformers.LlamaConfig(
        **common, **shape, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )


def _mistral(common, shape):
    import transformers

    return transformers.MistralConfig(**common, **shape, sliding_window=None, tie_word_embeddings=False)


def _qwen2(common, shape):
    import transformers

    return transformers.Qwen2Config(**common, **shape, tie_word_embeddings=True, use_sliding_window=False)


def _mixtral(common, shape):
    import transformers

    # 8 experts, top-2, like Mixtral-8x7B: decode batches of 1-3 tokens take the gathered-experts path.
    return transformers.MixtralConfig(**common, **shape, num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None, tie_word_embeddings=False)


def _deepseek_v3(common, shape):
    import transformers

    # DeepSeek-V3 in miniature: latent attention (q and kv low-rank, rope part 16 wide, v heads 24 wide),
    # one dense layer then mixtures of 8 experts, top-2 within the best 2 of 4 groups, one shared expert,
    # and yarn rope whose mscale_all_dim changes the softmax scale.
    return transformers.DeepseekV3Config(
        **common, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=3, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_attention_heads"], q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0})


def _qwen3(common, shape):
    import transformers

    # head_dim 32 != hidden / heads (16), as Qwen3-0.6B's 128 != 1024 / 16; biases on to load them too.
    return transformers.Qwen3Config(**common, **shape, head_dim=32, attention_bias=True,
                                    tie_word_embeddings=True, use_sliding_window=False)


def _qwen3_moe(common, shape):
    import transformers

    # 16 experts, top-4 (a decode batch of 4 rows routes 16 pairs), each a quarter of the dense width;
    # layer 0 dense by mlp_only_layers, so a dense and a sparse layer follow each other.
    layers = max(shape["num_hidden_layers"], 2)
    return transformers.Qwen3MoeConfig(
        **common, **{**shape, "num_hidden_layers": layers}, head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=shape["intermediate_size"] // 4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0], tie_word_embeddings=False, use_sliding_window=False)


def _gemma(common, shape):
    import transformers

    # head_dim 32 != hidden / heads (16), as Gemma-7B's 256 != 3072 / 16.
    return transformers.GemmaConfig(**common, **shape, head_dim=32, hidden_act="gelu_pytorch_tanh",
                                    tie_word_embeddings=True)


# Phi-3's LongRoPE, with an original length between the test's short sequences (prompt and answer) and its
# long prompts, so that both factor sets run, and Phi-4-mini's partial rotary factor (12 of 16 features
# rotated: 6 factors per set).
PHI3_ORIGINAL_LENGTH = 48
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "original_max_position_embeddings": PHI3_ORIGINAL_LENGTH,
             "short_factor": [1.0, 1.2, 1.5, 2.0, 2.7, 3.5], "long_factor": [1.0, 2.5, 6.0, 14.0, 30.0, 60.0]}


def _phi3(common, shape):
    import transformers

    # Phi-3-mini-4k's window, wider than any test sequence; fused qkv_proj and gate_up_proj in the checkpoint.
    return transformers.Phi3Config(**common, **shape, rope_parameters=dict(PHI3_ROPE),
                                   original_max_position_embeddings=PHI3_ORIGINAL_LENGTH,
                                   partial_rotary_factor=PHI3_ROPE["partial_rotary_factor"],
                                   sliding_window=2047, tie_word_embeddings=False, pad_token_id=None)


def _granite(common, shape):
    import transformers

    # Every multiplier far from 1 (and the softmax scale far from head_dim ** -0.5), so none can be skipped.
    return transformers.GraniteConfig(**common, **shape, embedding_multiplier=12.0, attention_multiplier=0.6,
                                      residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True)


def _gemma2(common, shape):
    import transformers

    # A window of 8 (local layer 0) and soft caps small enough to bend the tiny model's scores, so that
    # prompts and outputs past the window and a missing cap both change the greedy tokens; a
    # query_pre_attn_scalar other than head_dim.
    return transformers.Gemma2Config(**common, **shape, head_dim=32, hidden_activation="gelu_pytorch_tanh",
                                     sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                     query_pre_attn_scalar=24, tie_word_embeddings=True)


def _gemma3(common, shape):
    import transformers

    # Two local layers (window 10) to one global, local RoPE base 10,000 against the global 1,000,000 with
    # linear scaling, q/k norms, a final logit soft cap (an option Gemma 3 keeps).
    return transformers.Gemma3TextConfig(
        **common, **{**shape, "num_hidden_layers": 3}, head_dim=32, hidden_activation="gelu_pytorch_tanh",
        sliding_window=10, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=2.0, query_pre_attn_scalar=24, tie_word_embeddings=True)


def _gemma3_vlm(common, shape):
    import transformers

    # A Gemma3ForConditionalGeneration checkpoint (the published 4B-27B layout) around _gemma3's text model,
    # with a tiny SigLIP tower the runtime ignores (text-only serving). Image tokens at the top of the vocab.
    vocab = common["vocab_size"]
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    return transformers.Gemma3Config(text_config=_gemma3(common, shape), vision_config=vision, mm_tokens_per_image=4,
                                     boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1,
                                     tie_word_embeddings=True)


def _starcoder2(common, shape):
    import transformers

    # A window below max_position_embeddings: the runtime caps its context at it.
    return transformers.Starcoder2Config(**common, **shape, use_bias=True, sliding_window=2048,
                                         hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)


def _falcon(common, shape):
    import transformers

    # Falcon-40B/180B layout: grouped KV heads stored group by group in query_key_value, ln_attn + ln_mlp.
    return transformers.FalconConfig(
        **common, hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
        ffn_hidden_size=shape["intermediate_size"], new_decoder_architecture=True, parallel_attn=True,
        alibi=False, bias=False, tie_word_embeddings=False)


def _falcon7b(common, shape):
    import transformers

    # Falcon-7B layout: one KV head (replicated on every rank), one input_layernorm feeding attention and MLP.
    # Biases on (Falcon-7B has none) so that slicing the fused query_key_value bias is exercised too.
    return transformers.FalconConfig(
        **common, hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], ffn_hidden_size=shape["intermediate_size"],
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False, bias=True,
        tie_word_embeddings=True)


def _starcoder(common, shape):
    import transformers

    # GPTBigCode: multi-query attention, learned positions (n_positions), gelu-tanh MLP, tied head.
    common = {k: v for k, v in common.items() if k != "max_position_embeddings"}
    return transformers.GPTBigCodeConfig(
        **common, n_embd=shape["hidden_size"], n_layer=shape["num_hidden_layers"],
        n_head=shape["num_attention_heads"], n_inner=shape["intermediate_size"], n_positions=1024,
        multi_query=True, activation_function="gelu_pytorch_tanh", tie_word_embeddings=True)


def _llava(common, shape):
    import transformers

    # Llava-v1.6-Mistral in miniature: a CLIP tower on 32-pixel tiles of 8-pixel patches (16 per tile), a
    # 3-tile pinpoint set (a 1x2, 2x1 and 2x2 grid) and a Mistral language model. The image token is the
    # last id of the vocabulary (make_tiny_model adds it to the tokenizer).
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    text = transformers.MistralConfig(**common, **shape, sliding_window=None, tie_word_embeddings=False)
    return transformers.LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=common["vocab_size"] - 1,
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False)


IMAGE_TOKEN = "<image>"
IMAGE_FAMILIES = {"llava"}
# Families whose checkpoint is transformers' image-text-to-text class (the runtime may serve only the text).
CONDITIONAL_FAMILIES = IMAGE_FAMILIES | {"gemma3_vlm"}


def save_image_processor(out: Path, cfg, tok) -> None:
    """The image processor and LlavaNextProcessor (placeholder-token expansion) of a tiny Llava."""
    import transformers

    side = cfg.vision_config.image_size
    images = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        image_grid_pinpoints=cfg.image_grid_pinpoints)
    transformers.LlavaNextProcessor(
        image_processor=images, tokenizer=tok, patch_size=cfg.vision_config.patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN).save_pretrained(out)


def randomize_vectors(model_dir: str | Path, seed: int = 0, scale: float = 0.2) -> None:
    """Add noise to every 1-D weight (norm weights, biases) of the model in `model_dir`, in place.

    transformers initializes them to constants (0 or 1), under which a wrong norm formula
    (Gemma's ``1 + weight``) or a bias never loaded would go unnoticed.
    """
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.dim() == 1:
                tensors[name] = t + scale * torch.randn(t.shape, generator=gen).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


# family -> builder(common kwargs, shape kwargs) -> a transformers config of that family
FAMILIES = {
    "llama": _llama,
    "codellama": _llama,
    "llama31": _llama31,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "mixtral": _mixtral,
    "gemma": _gemma,
    "phi3": _phi3,
    "granite": _granite,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_vlm": _gemma3_vlm,
    "starcoder2": _starcoder2,
    "falcon": _falcon,
    "falcon7b": _falcon7b,
    "starcoder": _starcoder,
    "llava": _llava,
    "deepseek_v3": _deepseek_v3,
}


def make_config(family: str, vocab_size: int, size: str = "tiny", **overrides):
    shape = dict(SHAPES[size])
    common = dict(vocab_size=vocab_size, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                  initializer_range=0.1)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    cfg = FAMILIES[family](common, shape)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def save_tokenizer(out: str | Path, family: str = "llama", size: str = "tiny", seed: int = 0,
                   vocab_size: int = 512, tokenizer_from: str | Path | None = None):
    """Write the tokenizer of a tiny `family` model to `out`, with the config.json from which
    AutoTokenizer takes the model type; return (tokenizer, config). No weights: make_tiny_model."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        tok = train_tokenizer(vocab_size, seed, CHAT_TEMPLATES.get(family, CHAT_TEMPLATE))
    if family in IMAGE_FAMILIES:
        tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    if family in THINKING_FAMILIES and tokenizer_from is None:
        tok.add_tokens(THINK_TOKENS)
    tok.save_pretrained(out)
    cfg = make_config(family, len(tok), size)
    cfg.save_pretrained(out)
    if family in IMAGE_FAMILIES:
        save_image_processor(out, cfg, tok)
    return tok, cfg


def make_tiny_model(out: str | Path, family: str = "llama", size: str = "tiny", dtype: str = "float32",
                    seed: int = 0, vocab_size: int = 512, tokenizer_from: str | Path | None = None) -> Path:
    """Write config, safetensors weights and tokenizer to `out`; return it.

    `tokenizer_from`: a model directory whose tokenizer (and vocabulary size) the model takes instead
    of the small one trained here, e.g. one with few byte-fragment tokens, whose random output still
    streams as text.
    """
    import torch
    import transformers

    out = Path(out)
    _, cfg = save_tokenizer(out, family, size, seed, vocab_size, tokenizer_from)
    torch.manual_seed(seed)
    conditional = family in CONDITIONAL_FAMILIES
    auto = transformers.AutoModelForImageTextToText if conditional else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gaudi-serve tiny-model", description=__doc__)
    p.add_argument("out")
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", metavar="MODEL_DIR",
                   help="take this model's tokenizer and vocabulary instead of training a small one")
    a = p.parse_args(argv)
    print(make_tiny_model(a.out, a.family, a.size, a.dtype, a.seed, tokenizer_from=a.tokenizer_from))


if __name__ == "__main__":
    main()
