"""The reasoning split (router/reasoning.py): where an output starts, and the same (reasoning,
answer) whether the output comes whole or cut anywhere, inside `</think>` too."""

from __future__ import annotations

import pytest

from gaudi_runtime.router.reasoning import ANSWER, THINKING, UNDECIDED, Split, split, start_state

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_OFF = QWEN_PROMPT + "<think>\n\n</think>\n\n"
# A tool loop: an earlier turn's thinking is closed, and then the model answers anew.
QWEN_LOOP = QWEN_PROMPT + "<think>\nx\n</think>\n\ncall<|im_end|>\n<|im_start|>user\nok<|im_end|>\n" + QWEN_PROMPT


@pytest.mark.parametrize(("parser", "prompt", "state"), [
    ("deepseek_r1", R1_PROMPT, THINKING),
    ("deepseek_r1", QWEN_PROMPT, THINKING),  # vLLM's R1: before </think> is thinking, <think> or not
    ("qwen3", QWEN_PROMPT, UNDECIDED),
    ("qwen3", QWEN_PROMPT + "<think>\n", THINKING),  # Qwen3-2507 thinking models
    ("qwen3", QWEN_OFF, ANSWER),  # enable_thinking false
    ("qwen3", QWEN_LOOP, UNDECIDED),
    ("deepseek_r1", QWEN_OFF, ANSWER),
])
def test_where_the_output_starts(parser, prompt, state):
    assert start_state(parser, prompt) == state


CASES = [
    # (start state, output, reasoning, answer)
    (THINKING, "Let me see.\n1+1=2\n</think>\n\nThe answer is 2.", "Let me see.\n1+1=2\n", "The answer is 2."),
    (THINKING, "<think>\nhm</think>{\"a\": 1}", "\nhm", "{\"a\": 1}"),
    (UNDECIDED, "<think>\nwhy < and </ and </thin? ok</think>\n\nYes.", "\nwhy < and </ and </thin? ok", "Yes."),
    (UNDECIDED, "Just an answer with </think> in it", None, "Just an answer with </think> in it"),
    (UNDECIDED, "<thinking is a word", None, "<thinking is a word"),
    (ANSWER, "{\"x\": \"<think>\"}", None, "{\"x\": \"<think>\"}"),
    (THINKING, "cut short by the budget, still thinking </thi", "cut short by the budget, still thinking </thi", ""),
    (THINKING, "done</think>", "done", ""),
    (UNDECIDED, "", None, ""),
    (UNDECIDED, "<thi", None, "<thi"),
]


@pytest.mark.parametrize(("state", "text", "reasoning", "answer"), CASES)
def test_whole_outputs(state, text, reasoning, answer):
    assert split(state, text) == (reasoning, answer)


@pytest.mark.parametrize(("state", "text", "reasoning", "answer"), CASES)
def test_streams_cut_anywhere_add_up_to_the_whole(state, text, reasoning, answer):
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            s, got_r, got_a = Split(state), "", ""
            for piece, final in ((text[:a], False), (text[a:b], False), (text[b:], True)):
                r, c = s.add(piece, final)
                got_r, got_a = got_r + r, got_a + c
            assert (got_r, got_a) == (reasoning or "", answer), (a, b)


def test_the_answer_streams_once_it_starts_and_no_marker_text_leaks():
    s = Split(THINKING)
    pieces = ["I think", " so", "</", "think", ">", "\n", "\n", "Yes", ".", ""]
    out = [s.add(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert out == [("I think", ""), (" so", ""), ("", ""), ("", ""), ("", ""), ("", ""), ("", ""),
                   ("", "Yes"), ("", "."), ("", "")]


def test_the_launcher_refuses_a_tokenizer_without_single_thinking_tokens(tmp_path):
    from gaudi_runtime.config import Config, ConfigError
    from gaudi_runtime.launcher import check_reasoning
    from gaudi_runtime.tools.tiny_model import train_tokenizer

    tok = train_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg = Config.of(model_id="m", reasoning_parser="qwen3")
    with pytest.raises(ConfigError, match=r"--reasoning-parser qwen3: the tokenizer does not hold <think> and "):
        check_reasoning(cfg, str(tmp_path))
    check_reasoning(Config.of(model_id="m"), str(tmp_path))  # no parser: nothing to check
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(tmp_path)
    check_reasoning(cfg, str(tmp_path))


def test_an_earlier_answers_thinking_reaches_the_template_under_both_names():
    from gaudi_runtime.router.openai_validation import chat_messages
    from gaudi_runtime.router.request_models import ChatCompletionRequest, parse_request

    req = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."},
        {"role": "user", "content": "and?"}]})
    assert chat_messages(req.messages)[1] == {"role": "assistant", "content": "Hello.", "reasoning": "Greet back.",
                                              "reasoning_content": "Greet back."}
