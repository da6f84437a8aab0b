"""On the real runtime: a reasoning model's grammar waits for `</think>`, then constrains the answer.

A random tiny Qwen2 whose tokenizer holds `<think>` and `</think>` as single tokens, and whose
`</think>` row of the (tied) output embedding is set to win at its fourth greedy step and at no
earlier one: so it thinks three free tokens, then ends its thinking by itself. Greedy decoding, compared with `transformers` on the same weights: the thinking is what
the unconstrained model generates (no mask before `</think>`; a JSON grammar would have forbidden
those tokens), and the answer after it follows the JSON schema (the mask from then on)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, train_tokenizer
from tests.runtime.launched import serve_small

# DeepSeek-R1's way: the prompt opens the thinking.
TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|><think>\n{%- endif %}")
MESSAGES = [{"role": "user", "content": "Is the sky blue today?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _model_that_ends_its_thinking(tmp, k: int = 3) -> tuple[str, list[int]]:
    """The model directory, and the `k` tokens it thinks (greedily) before its `</think>`: that token's
    output row is the part of the step-`k` hidden state orthogonal to the earlier steps', scaled to win
    there (its logit at the earlier steps is 0)."""
    import torch
    import transformers

    tok = train_tokenizer(chat_template=TEMPLATE)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(tmp / "tok")
    model_dir = make_tiny_model(tmp / "model", "qwen2", tokenizer_from=tmp / "tok")
    end = tok.convert_tokens_to_ids("</think>")
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    free = _greedy(model, prompt, k)
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + free])).last_hidden_state[0, len(prompt) - 1:]  # [k + 1, H]
        q, _ = torch.linalg.qr(hidden[:k].T)
        u = hidden[k] - q @ (q.T @ hidden[k])
        best = model.lm_head(hidden[k]).max()
        model.get_output_embeddings().weight[end] = u * (best.abs() + 5) / (u @ hidden[k])
    got = _greedy(model, prompt, k + 1)
    assert got == free + [end], (free, got)
    model.save_pretrained(model_dir, safe_serialization=True)
    return str(model_dir), free


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("think")
    model_dir, thought = _model_that_ends_its_thinking(tmp)
    srv = serve_small(model_dir, tmp_path_factory.mktemp("think-run"), "--reasoning-parser", "deepseek_r1")
    yield srv, thought, model_dir
    srv.stop()


def test_the_grammar_constrains_only_the_answer_after_the_thinking(served):
    from transformers import AutoTokenizer

    srv, thought, model_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning"] == tok.decode(thought), "the thinking is the unconstrained model's own"
    assert not tok.decode(thought).lstrip().startswith("{"), "which a JSON grammar would have forbidden"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
