"""gpt-oss's harmony format against its official chat template (openai/gpt-oss-*'s chat_template.jinja, run by
transformers' apply_chat_template on a tiny tokenizer.json with the hub's 21 added tokens), its "Current date" fixed
on both sides: the system and developer messages, replies on the final channel, the last one ending with <|return|>
and keeping its reasoning, generation prompts, reasoning effort, the trained tokens, and what both refuse.

Mutations seen failing: every reply ending with <|return|> (the template's rule is only the last); reasoning kept
on earlier replies too; the reasoning kept with a generation prompt; "Reasoning: medium" written whatever the
setting; an empty system message still giving a developer message; the <|start|>assistant of a reply trained; ids
hard-coded at the tiny file's positions instead of read from its added tokens."""

import datetime
import json
import shutil

import pytest

from mtune.tokenizers import Message, detect_tokenizer, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from mtune.tokenizers.gpt_oss import DEFAULT_DATE, GptOssTokenizer
from tests._helpers.tokenizers import (CONVERSATIONS, GPT_OSS_FIRST_SPECIAL, GPT_OSS_HUB_IDS, PHI4_BASE_VOCAB,
                                     trained_text_runs)

REASONED = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "what is 2 + 3?"},
    {"role": "assistant", "content": "It's 5.", "thinking": "add them"},
    {"role": "user", "content": "and 4 + 4?"},
    {"role": "assistant", "content": "It's 8.", "thinking": "four and four"},
]


@pytest.fixture
def hf(hf_tokenizers, monkeypatch):
    """transformers' tokenizer of the tiny checkpoint, its template's strftime_now pinned to DEFAULT_DATE (the date
    of ``today`` overrides it)."""
    import transformers.utils.chat_template_utils as chat_utils

    class Today(datetime.datetime):
        day_of = datetime.date.fromisoformat(DEFAULT_DATE)

        @classmethod
        def now(cls, tz=None):
            return cls(cls.day_of.year, cls.day_of.month, cls.day_of.day)

    monkeypatch.setattr(chat_utils, "datetime", Today)
    hf_tokenizers["gpt_oss"].today = Today
    return hf_tokenizers["gpt_oss"]


def hf_ids(hf, messages, **kwargs):
    dicts = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    return hf(hf.apply_chat_template(dicts, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]


def as_messages(messages):
    return [Message(**m) if isinstance(m, dict) else Message(*m) for m in messages]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_conversations_and_their_prompts_match_the_template(name, tokenizer_dirs, hf):
    tok = load_tokenizer(tokenizer_dirs["gpt_oss"])
    assert isinstance(tok, GptOssTokenizer) and tok.current_date == DEFAULT_DATE
    messages = CONVERSATIONS[name]
    result = tok.tokenize_messages(as_messages(messages))
    assert result.tokens == hf_ids(hf, messages) and not result.truncated
    replies = [content for role, content in messages if role == "assistant"]
    expected = [f"<|channel|>final<|message|>{reply}<|end|>" for reply in replies]
    expected[-1] = expected[-1].removesuffix("<|end|>") + "<|return|>"
    assert trained_text_runs(tok, result) == expected
    # each prefix ending with a user turn, as a generation prompt: the template's ids, which the conversation
    # continues, the prompt <|start|>assistant not trained
    for end, (role, _) in enumerate(messages):
        if role == "user":
            prompt = tok.tokenize_messages(as_messages(messages[: end + 1]), add_generation_prompt=True)
            assert prompt.tokens == hf_ids(hf, messages[: end + 1], add_generation_prompt=True)
            assert result.tokens[: len(prompt.tokens)] == prompt.tokens
            assert result.trained[: len(prompt.tokens)] == prompt.trained and not any(prompt.trained[-2:])
            assert tok.decode(prompt.tokens[-2:], skip_special_tokens=False) == "<|start|>assistant"
    text = tok.decode(result.tokens, skip_special_tokens=False)
    assert text.startswith(f"<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           f"Knowledge cutoff: 2024-06\nCurrent date: {DEFAULT_DATE}\n\nReasoning: medium\n\n"
                           "# Valid channels: analysis, commentary, final. Channel must be included for every "
                           "message.<|end|>")
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief and exact.\n\n<|end|><|start|>user" in text) == (
        name == "system")


@pytest.mark.parametrize("n", [3, 5])
def test_reasoning_only_on_the_last_reply_and_never_in_a_prompt(n, tokenizer_dirs, hf):
    tok = load_tokenizer(tokenizer_dirs["gpt_oss"])
    messages = REASONED[:n]
    result = tok.tokenize_messages(as_messages(messages))
    assert result.tokens == hf_ids(hf, messages)
    last = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>{}<|return|>"
    expected = ([last.format("add them", "It's 5.")] if n == 3 else
                ["<|channel|>final<|message|>It's 5.<|end|>", last.format("four and four", "It's 8.")])
    assert trained_text_runs(tok, result) == expected
    # with a generation prompt the last reply is an earlier one: its reasoning goes, it ends with <|end|>
    prompt = tok.tokenize_messages(as_messages(messages), add_generation_prompt=True)
    assert prompt.tokens == hf_ids(hf, messages, add_generation_prompt=True)
    assert "<|channel|>analysis" not in tok.decode(prompt.tokens, skip_special_tokens=False)
    # empty reasoning is still a field the template renders (an empty analysis message); no field, none
    empty = [*messages[:-1], {**messages[-1], "thinking": ""}]
    assert tok.tokenize_messages(as_messages(empty)).tokens == hf_ids(hf, empty)
    bare = [*messages[:-1], {"role": "assistant", "content": messages[-1]["content"]}]
    assert tok.tokenize_messages(as_messages(bare)).tokens == hf_ids(hf, bare)


def test_settings_render_as_the_template_kwargs_do(tokenizer_dirs, hf):
    path, prompt = tokenizer_dirs["gpt_oss"], REASONED[:4]
    default = load_tokenizer(path)
    prints = {default.fingerprint()}
    for effort in ("low", "high"):
        tok = load_tokenizer(path, reasoning_effort=effort)
        ids = tok.tokenize_messages(as_messages(prompt), add_generation_prompt=True).tokens
        assert ids == hf_ids(hf, prompt, add_generation_prompt=True, reasoning_effort=effort)
        assert f"\nReasoning: {effort}\n" in tok.decode(ids, skip_special_tokens=False)
        prints.add(tok.fingerprint())
    identity = "You are a terse assistant."
    tok = load_tokenizer(path, model_identity=identity)
    assert tok.tokenize_messages(as_messages(prompt)).tokens == hf_ids(hf, prompt, model_identity=identity)
    prints.add(tok.fingerprint())
    tok = load_tokenizer(path, current_date="2026-11-26")
    hf.today.day_of = datetime.date(2026, 11, 26)
    assert tok.tokenize_messages(as_messages(prompt)).tokens == hf_ids(hf, prompt)
    prints.add(tok.fingerprint())
    assert len(prints) == 5  # the data cache tells them apart
    # an empty system message gives no developer message, as in the template
    hf.today.day_of = datetime.date.fromisoformat(DEFAULT_DATE)
    quiet = [{"role": "system", "content": ""}, *REASONED[1:3]]
    assert default.tokenize_messages(as_messages(quiet)).tokens == hf_ids(hf, quiet)


def test_special_ids_come_from_the_files_added_tokens(tokenizer_dirs, hf, tmp_path):
    tok = load_tokenizer(tokenizer_dirs["gpt_oss"])

    def tiny(name):  # the tiny file keeps the hub's order: hub id 199998 + k sits at 500 + k
        return PHI4_BASE_VOCAB + GPT_OSS_HUB_IDS[name] - GPT_OSS_FIRST_SPECIAL

    for name in ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|channel|>", "<|start|>", "<|end|>",
                 "<|message|>", "<|call|>"):
        assert tok.control_ids[name] == hf.convert_tokens_to_ids(name) == tiny(name), name
    assert tok.bos_id is None and tok.startoftext_id == tiny("<|startoftext|>")
    assert tok.eos_id == tok.pad_id == hf.pad_token_id == tiny("<|endoftext|>")
    assert tok.end_of_turn_id == hf.eos_token_id == tiny("<|return|>")
    assert tok.stop_tokens == [tiny("<|return|>"), tiny("<|call|>"), tiny("<|endoftext|>")]
    assert tok.vocab_size == len(hf) == 521
    # transformers adds no <|startoftext|> to a text (the file's post-processor is byte-level only); nor does mtune
    assert tok.encode("hello world", add_bos=True, add_eos=False) == hf("hello world")["input_ids"]
    # the same names at other ids: mtune follows the file
    moved = shutil.copytree(tokenizer_dirs["gpt_oss"], tmp_path / "moved")
    spec = json.loads((moved / "tokenizer.json").read_text())
    by_name = {t["content"]: t for t in spec["added_tokens"]}
    by_name["<|start|>"]["id"], by_name["<|end|>"]["id"] = by_name["<|end|>"]["id"], by_name["<|start|>"]["id"]
    spec["added_tokens"].sort(key=lambda t: t["id"])  # (the `tokenizers` library reads them in id order)
    (moved / "tokenizer.json").write_text(json.dumps(spec))
    other = load_tokenizer(moved)
    assert (other.start_id, other.end_id) == (tok.end_id, tok.start_id)
    conversation = as_messages(CONVERSATIONS["single"])
    swap = {tok.start_id: tok.end_id, tok.end_id: tok.start_id}
    assert other.tokenize_messages(conversation).tokens == [
        swap.get(t, t) for t in tok.tokenize_messages(conversation).tokens]


def test_truncation_ends_with_return(tokenizer_dirs):
    tok = load_tokenizer(tokenizer_dirs["gpt_oss"])
    messages = as_messages(REASONED)
    full = tok.tokenize_messages(messages)
    cut = tok.tokenize_messages(messages, max_seq_len=len(full.tokens) - 5)
    assert cut.truncated and cut.tokens[-1] == tok.return_id and cut.trained[-1]
    assert cut.tokens[:-1] == full.tokens[: len(full.tokens) - 6]


def test_refuses_what_it_cannot_render(tokenizer_dirs, hf):
    tok = load_tokenizer(tokenizer_dirs["gpt_oss"])
    tagged = "<|channel|>analysis<|message|>hmm"
    for field, messages in [("content", [("user", "q"), {"role": "assistant", "content": tagged}]),
                            ("thinking", [("user", "q"), {"role": "assistant", "content": "a", "thinking": tagged}])]:
        with pytest.raises(TokenizerError, match=rf"^gpt_oss chat format: message 1's {field} holds harmony channel"):
            tok.tokenize_messages(as_messages(messages))
        with pytest.raises(Exception, match=f"containing <\\|channel\\|> tags in the {field} field"):
            hf_ids(hf, messages)
    # the template drops a later system message without a word; mtune refuses it
    with pytest.raises(TokenizerError, match="message 2 is a system message; only the first message may be one"):
        tok.tokenize_messages([Message("user", "q"), Message("assistant", "a"), Message("system", "late")])
    with pytest.raises(ValueError, match="role 'developer' is not supported"):
        Message("developer", "x")
    with pytest.raises(ValueError, match="thinking must be text on an assistant message, got str on a user"):
        Message("user", "q", thinking="t")
    with pytest.raises(TokenizerError, match="current_date='26/11/2026' is not a YYYY-MM-DD date"):
        load_tokenizer(tokenizer_dirs["gpt_oss"], current_date="26/11/2026")
    with pytest.raises(TokenizerError, match="reasoning_effort='max' is not one of low, medium, high"):
        load_tokenizer(tokenizer_dirs["gpt_oss"], reasoning_effort="max")
    with pytest.raises(TokenizerError, match="option enable_thinking does not apply to the gpt_oss tokenizer; it "
                                             "takes current_date, reasoning_effort, model_identity"):
        load_tokenizer(tokenizer_dirs["gpt_oss"], enable_thinking=False)
    # a family whose template has no reasoning field refuses one, rather than drop it
    with pytest.raises(TokenizerError, match="llama3 chat format: a message has reasoning"):
        load_tokenizer(tokenizer_dirs["llama3"]).tokenize_messages(as_messages(REASONED[:3]))


def test_found_by_model_type_and_by_its_tokens(tokenizer_dirs, tmp_path):
    directory = tokenizer_dirs["gpt_oss"]
    assert json.loads((directory / "config.json").read_text())["model_type"] == "gpt_oss"
    assert detect_tokenizer(directory) == ("gpt_oss", directory / "tokenizer.json")
    assert detect_tokenizer(directory / "tokenizer.json") == ("gpt_oss", directory / "tokenizer.json")
    bare = shutil.copytree(directory, tmp_path / "bare")
    (bare / "config.json").unlink()
    assert isinstance(load_tokenizer(bare), GptOssTokenizer)
    (bare / "tokenizer.json").unlink()
    (bare / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(FileNotFoundError, match="a gpt_oss model without tokenizer.json"):
        load_tokenizer(bare)
