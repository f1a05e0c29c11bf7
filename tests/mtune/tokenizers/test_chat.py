"""Chat rendering against each family's official template run by transformers' apply_chat_template."""

import pytest

from mtune.tokenizers import Message, load_tokenizer
from tests._helpers.tokenizers import CONVERSATIONS

FAMILIES = ["llama2", "llama3", "mistral", "qwen2", "qwen3", "qwen3_5", "phi4", "phi4_mini", "gemma3", "gemma4"]
# How a trained run (one assistant reply) decodes, with special tokens spelled out.
REPLY_AS_DECODED = {
    "llama3": lambda reply: reply.strip() + "<|eot_id|>",
    "llama2": lambda reply: reply.strip() + " </s>",
    "mistral": lambda reply: reply.strip() + "</s>",
    "qwen2": lambda reply: reply + "<|im_end|>",
    "qwen3": lambda reply: reply + "<|im_end|>",  # the last reply also opens with its (empty) thinking block
    "qwen3_5": lambda reply: reply.strip() + "<|im_end|>",  # likewise
    "phi4": lambda reply: reply + "<|im_end|>",
    "phi4_mini": lambda reply: reply + "<|end|>",
    "gemma3": lambda reply: reply.strip() + "<end_of_turn>",
    "gemma4": lambda reply: reply.strip() + "<turn|>",
}


def hf_ids(hf, messages, add_generation_prompt=False):
    dicts = [{"role": role, "content": content} for role, content in messages]
    text = hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
    return hf(text, add_special_tokens=False)["input_ids"]


def trained_runs(conversation):
    runs, current = [], []
    for token, trained in zip(conversation.tokens, conversation.trained):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_conversation_matches_official_template(family, name, tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs[family]), hf_tokenizers[family]
    messages = CONVERSATIONS[name]
    result = tok.tokenize_messages([Message(role, content) for role, content in messages])
    assert len(result.tokens) == len(result.trained) and not result.truncated
    if not (family == "mistral" and messages[0][0] == "system"):
        # (Mistral's template drops a system message unless the conversation ends with a user turn: below.)
        assert result.tokens == hf_ids(hf, messages)
    replies = [content for role, content in messages if role == "assistant"]
    runs = trained_runs(result)
    decoded = [tok.decode(run, skip_special_tokens=False) for run in runs]
    expected = [REPLY_AS_DECODED[family](reply) for reply in replies]
    if family in ("qwen3", "qwen3_5"):
        expected[-1] = "<think>\n\n</think>\n\n" + expected[-1]
    assert decoded == expected
    # Every prompt (the conversation up to each user turn) renders as the template's generation prompt, and the
    # full conversation continues it.
    for end, (role, _) in enumerate(messages):
        if role != "user":
            continue
        prompt = tok.tokenize_messages([Message(*m) for m in messages[: end + 1]], add_generation_prompt=True)
        expected = hf_ids(hf, messages[: end + 1], add_generation_prompt=True)
        if family == "mistral" and end + 1 < len(messages) and messages[0][0] == "system":
            # mistral-common puts the system prompt on the last user turn of the conversation, not of the prefix.
            continue
        assert prompt.tokens == expected and not prompt.trained[-1]
        if family == "qwen3_5":
            # Qwen3.5's generation prompt opens a thinking block that a reply before a later user turn drops.
            continue
        if family != "mistral" or messages[0][0] != "system" or end == len(messages) - 2:
            assert result.tokens[: len(expected)] == expected
            assert result.trained[: len(expected)] == prompt.trained


def test_mistral_system_prompt_goes_to_last_user_turn(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["mistral"]), hf_tokenizers["mistral"]
    messages = CONVERSATIONS["system"]
    result = tok.tokenize_messages([Message(*m) for m in messages])
    prompt = hf_ids(hf, messages[:-1])  # ends with the last user turn: the template keeps the system prompt
    assert result.tokens[: len(prompt)] == prompt
    assert tok.decode(result.tokens[len(prompt):], skip_special_tokens=False) == "naïve data\n\nmemory</s>"


def test_llama2_matches_meta_reference_encoding(tokenizer_dirs):
    # Meta's chat_completion: sentencepiece over "[INST] {user} [/INST] {reply} " with bos/eos per pair.
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_dirs["llama2"] / "tokenizer.model"))
    tok = load_tokenizer(tokenizer_dirs["llama2"])
    messages = CONVERSATIONS["system"]
    first = f"<<SYS>>\n{messages[0][1]}\n<</SYS>>\n\n{messages[1][1]}"
    expected = [1] + sp.encode(f"[INST] {first.strip()} [/INST] {messages[2][1].strip()} ") + [2]
    expected += [1] + sp.encode(f"[INST] {messages[3][1].strip()} [/INST] {messages[4][1].strip()} ") + [2]
    assert tok.tokenize_messages([Message(*m) for m in messages]).tokens == expected


def test_qwen_default_system_prompt(tokenizer_dirs, tmp_path):
    import json
    import shutil

    tok = load_tokenizer(tokenizer_dirs["qwen2"])
    conversation = [Message("user", "hi")]
    text = tok.decode(tok.tokenize_messages(conversation).tokens, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                           "assistant.<|im_end|>\n<|im_start|>user\nhi")
    # A Qwen2 (not 2.5) template adds "You are a helpful assistant." instead.
    qwen2 = shutil.copytree(tokenizer_dirs["qwen2"], tmp_path / "qwen2")
    config = json.loads((qwen2 / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "You are a helpful assistant.")
    (qwen2 / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_tokenizer(qwen2)
    assert other.system_prompt == "You are a helpful assistant."
    assert other.fingerprint() != tok.fingerprint()
    assert tok.decode(other.tokenize_messages(conversation).tokens, skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    # Saved by recent transformers, the template is chat_template.jinja, which wins over tokenizer_config.json's
    # (as transformers reads it): Qwen2's template there, Qwen2.5's (or none) in the config.
    jinja = shutil.copytree(tokenizer_dirs["qwen2"], tmp_path / "qwen2_jinja")
    (jinja / "chat_template.jinja").write_text(config["chat_template"])
    assert load_tokenizer(jinja).system_prompt == "You are a helpful assistant."
    config = json.loads((jinja / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (jinja / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(jinja).system_prompt == "You are a helpful assistant."


@pytest.mark.parametrize("family", FAMILIES)
def test_truncation_keeps_end_of_turn(family, tokenizer_dirs):
    tok = load_tokenizer(tokenizer_dirs[family])
    messages = [Message(*m) for m in CONVERSATIONS["multi"]]
    full = tok.tokenize_messages(messages)
    last_reply = max(i for i, t in enumerate(full.trained) if t)
    for limit in (last_reply - 2, len(full.tokens) - 1):  # cut inside the last reply; cut the final token(s)
        cut = tok.tokenize_messages(messages, max_seq_len=limit)
        assert cut.truncated and len(cut.tokens) == len(cut.trained) == limit
        assert cut.tokens[:-1] == full.tokens[: limit - 1] and cut.trained[:-1] == full.trained[: limit - 1]
        assert cut.tokens[-1] == tok.end_of_turn_id
    assert tok.tokenize_messages(messages, max_seq_len=last_reply - 2).trained[-1]
    same = load_tokenizer(tokenizer_dirs[family], max_seq_len=len(full.tokens))
    assert same.tokenize_messages(messages) == full


def test_gemma4_drops_thought_blocks_of_replies_as_its_template_does(tokenizer_dirs, hf_tokenizers):
    """The official template renders an earlier reply without its thought block; trained, the reply without it."""
    tok, hf = load_tokenizer(tokenizer_dirs["gemma4"]), hf_tokenizers["gemma4"]
    reply = "<|channel>thought\nwork it out<channel|>  It's 12351. "
    messages = [("user", "12345 + 6?"), ("assistant", reply), ("user", "and + 1?")]
    result = tok.tokenize_messages([Message(*m) for m in messages], add_generation_prompt=True)
    assert result.tokens == hf_ids(hf, messages, add_generation_prompt=True)
    assert [tok.decode(run, skip_special_tokens=False) for run in trained_runs(result)] == ["It's 12351.<turn|>"]


@pytest.mark.parametrize("family", ["llama2", "mistral", "gemma3", "gemma4"])
def test_alternation_errors(family, tokenizer_dirs):
    tok = load_tokenizer(tokenizer_dirs[family])
    with pytest.raises(ValueError, match="must alternate"):
        tok.tokenize_messages([Message("user", "a"), Message("user", "b")])
    with pytest.raises(ValueError, match="role 'ipython' is not supported"):
        Message("ipython", "x")
