"""Qwen3's thinking block against its official template (run by transformers' apply_chat_template)."""

import pytest

from mtune.tokenizers import Message, load_tokenizer
from mtune.tokenizers.qwen3 import split_reasoning

REASONED = [
    ("user", "what is 2 + 3?"),
    ("assistant", "<think>\nadd them\n</think>\n\nIt's 5."),
    ("user", "and 4 + 4?"),
    ("assistant", "<think>\n\nfour and four\n\n</think>\n\n\nIt's 8."),
]


def hf_ids(hf, messages, **kwargs):
    dicts = [{"role": role, "content": content} for role, content in messages]
    return hf(hf.apply_chat_template(dicts, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("n", [2, 4])
def test_reasoning_kept_after_last_user_and_dropped_before(n, tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen3"]), hf_tokenizers["qwen3"]
    messages = REASONED[:n]
    result = tok.tokenize_messages([Message(*m) for m in messages])
    assert result.tokens == hf_ids(hf, messages)
    trained = [t for t, keep in zip(result.tokens, result.trained) if keep]
    text = tok.decode(trained, skip_special_tokens=False)
    last = "<think>\nadd them\n</think>\n\nIt's 5." if n == 2 else "<think>\nfour and four\n</think>\n\nIt's 8."
    assert text == ("" if n == 2 else "It's 5.<|im_end|>") + last + "<|im_end|>"
    assert tok.think_start_id == hf.convert_tokens_to_ids("<think>") and tok.think_start_id in result.tokens


def test_no_default_system_prompt_and_generation_prompts(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen3"]), hf_tokenizers["qwen3"]
    prompt = [("user", "hi")]
    ids = tok.tokenize_messages([Message(*prompt[0])], add_generation_prompt=True).tokens
    assert ids == hf_ids(hf, prompt, add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    quiet = load_tokenizer(tokenizer_dirs["qwen3"])
    quiet.enable_thinking = False
    assert quiet.tokenize_messages([Message(*prompt[0])], add_generation_prompt=True).tokens == hf_ids(
        hf, prompt, add_generation_prompt=True, enable_thinking=False)
    assert quiet.fingerprint() != tok.fingerprint()


def test_split_reasoning_as_the_template_does():
    assert split_reasoning("plain") == ("", "plain")
    assert split_reasoning("<think>\n\nwhy\n</think>\n\nanswer") == ("why", "answer")
    assert split_reasoning("no start</think>answer") == ("no start", "answer")
