"""Qwen3.5's chat format against its official template (Qwen/Qwen3.5-27B's, run by transformers'
apply_chat_template on a tiny tokenizer written in the test): thinking blocks on every reply after the last user
query, trimmed texts, both generation prompts, and what the template refuses.

Mutations seen failing: the thinking block only on the last reply (Qwen3's rule); the generation prompt without
``<think>\\n``; contents not trimmed; a ``<tool_response>`` user message counted as the last query."""

import pytest

from mtune.tokenizers import Message, detect_tokenizer, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from mtune.tokenizers.qwen3_5 import Qwen3_5Tokenizer

CONVERSATION = [
    ("system", "  Be exact.\n"),
    ("user", "what is 2 + 3?"),
    ("assistant", "<think>\nadd them\n</think>\n\nIt's 5."),
    ("user", " and 4 + 4? "),
    ("assistant", "<think>\n\n  four and four \n\n</think>\n\n\nIt's 8.  "),
    ("assistant", "Anything else?"),  # after the last query too: its own (empty) thinking block
    ("user", "<tool_response>\n8\n</tool_response>"),  # a tool's output is not a query
    ("assistant", "Done."),
]


def hf_ids(hf, messages, **kwargs):
    dicts = [{"role": role, "content": content} for role, content in messages]
    return hf(hf.apply_chat_template(dicts, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("n", [3, 5, 6, 8])
def test_conversation_and_trained_tokens_match_the_template(n, tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen3_5"]), hf_tokenizers["qwen3_5"]
    assert isinstance(tok, Qwen3_5Tokenizer) and tok.system_prompt is None
    messages = CONVERSATION[:n]
    result = tok.tokenize_messages([Message(*m) for m in messages])
    assert result.tokens == hf_ids(hf, messages)
    trained = tok.decode([t for t, keep in zip(result.tokens, result.trained) if keep], skip_special_tokens=False)
    expected = {
        3: "<think>\nadd them\n</think>\n\nIt's 5.<|im_end|>",
        5: "It's 5.<|im_end|><think>\nfour and four\n</think>\n\nIt's 8.<|im_end|>",
        6: "It's 5.<|im_end|><think>\nfour and four\n</think>\n\nIt's 8.<|im_end|>"
           "<think>\n\n</think>\n\nAnything else?<|im_end|>",
        8: "It's 5.<|im_end|><think>\nfour and four\n</think>\n\nIt's 8.<|im_end|>"
           "<think>\n\n</think>\n\nAnything else?<|im_end|><think>\n\n</think>\n\nDone.<|im_end|>",
    }[n]
    assert trained == expected


def test_generation_prompts(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen3_5"]), hf_tokenizers["qwen3_5"]
    prompt = CONVERSATION[:4]
    ids = tok.tokenize_messages([Message(*m) for m in prompt], add_generation_prompt=True).tokens
    assert ids == hf_ids(hf, prompt, add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nand 4 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    quiet = load_tokenizer(tokenizer_dirs["qwen3_5"])
    quiet.enable_thinking = False
    assert quiet.tokenize_messages([Message(*m) for m in prompt], add_generation_prompt=True).tokens == hf_ids(
        hf, prompt, add_generation_prompt=True, enable_thinking=False)
    assert quiet.fingerprint() != tok.fingerprint()


def test_refuses_what_the_template_refuses(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen3_5"]), hf_tokenizers["qwen3_5"]
    for messages, message in [([("user", "hi"), ("system", "late")], "may only come first"),
                              ([("system", "s"), ("assistant", "a")], "no user message"),
                              ([("user", "<tool_response>x</tool_response>")], "no user message")]:
        with pytest.raises(TokenizerError, match=message):
            tok.tokenize_messages([Message(*m) for m in messages])
        with pytest.raises(Exception, match="System message must be at the beginning|No user query"):
            hf_ids(hf, messages)


def test_model_types_pick_the_qwen3_5_format(tokenizer_dirs, tmp_path):
    import json
    import shutil

    assert detect_tokenizer(tokenizer_dirs["qwen3_5"])[0] == "qwen3_5"  # model_type qwen3_5_text
    multimodal = shutil.copytree(tokenizer_dirs["qwen3_5"], tmp_path / "mm")
    for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text"):  # the multimodal and MoE checkpoints
        (multimodal / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": {}}))
        assert detect_tokenizer(multimodal)[0] == "qwen3_5"
