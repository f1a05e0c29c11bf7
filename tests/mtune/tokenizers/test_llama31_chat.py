"""Llama 3.1 / 3.2 / 3.3 conversations without tool calling against Meta's official templates run by transformers'
apply_chat_template: tests/assets/chat_templates/llama3_1.jinja (Llama 3.1's, byte-identical to 3.3's) and
llama3_2.jinja (its ``strftime_now`` pinned to 26 Jul 2024, mtune's ``date_string`` default), on the tiny Llama 3 rank
file. Those templates open every conversation with their system turn (``Cutting Knowledge Date: December 2023\\nToday
Date: ...\\n\\n{system}``); ids equal transformers', and the trained mask equals the one read off the template's text
(replies after their header up to their ``<|eot_id|>``). Then the choice of format: read from the checkpoint's
template (``chat_template.jinja`` before ``tokenizer_config.json``, as transformers reads them; Llama 3's template and
no template keep Llama 3's format), or forced by the ``date_header`` option.

Mutations seen failing: ``auto`` read as ``never`` (the template's turn never written without tools: 4 tests here,
2 in test_llama3_tool_calls.py); ``tokenizer_config.json`` read before ``chat_template.jinja`` (1); the system turn
trained (4); ``never`` read as ``auto`` (1); the system message not trimmed in that turn (3); the fingerprint without
the outcome of ``date_header`` (1).
"""

import shutil

import pytest

from mtune.tokenizers import load_tokenizer
from mtune.tokenizers.base import TokenizerError
from mtune.tokenizers.llama3 import CHAT_TEMPLATE as LLAMA3_CHAT_TEMPLATE
from tests._helpers.tokenizers import (CHAT_TEMPLATES, CONVERSATIONS, pin_template_day, trained_text_runs,
                                      write_llama3_tokenizer)
from tests._helpers.tool_calls import ONE_CALL, TOOLS, template_ids_and_mask

REPLY_OPEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"
SYSTEM_TURN = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
               "Today Date: 26 Jul 2024\n\n")
# CONVERSATIONS (one turn, a system message and two turns, two turns without one) and a system message padded with
# whitespace, which the template trims.
CASES = {name: [{"role": role, "content": content} for role, content in messages]
         for name, messages in CONVERSATIONS.items()}
CASES["padded_system"] = [{"role": "system", "content": "\n  Answer in French. "},
                          {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Bonjour !"}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (model directory, transformers tokenizer)}: "3.1" and "3.2" carry their release's template, "3.0"
    Llama 3's (no date lines)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama31_chat")
    out = {}
    for name, template in (("3.1", "llama3_1.jinja"), ("3.2", "llama3_2.jinja"), ("3.0", None)):
        write_llama3_tokenizer(root / name, release="3.2" if name == "3.0" else name,
                               chat_template=template and (CHAT_TEMPLATES / template).read_text())
        out[name] = (root / name, AutoTokenizer.from_pretrained(root / name))
    return out


@pytest.fixture(autouse=True)
def pinned_day(monkeypatch):
    pin_template_day(monkeypatch)


def assert_matches(tok, hf, messages, add_generation_prompt=False, **kwargs):
    result = tok.tokenize_messages(messages, add_generation_prompt=add_generation_prompt)
    ids, mask = template_ids_and_mask(hf, messages, None, REPLY_OPEN, "<|eot_id|>",
                                      add_generation_prompt=add_generation_prompt, **kwargs)
    assert result.tokens == ids
    assert result.trained == mask
    return result


@pytest.mark.parametrize("release", ["3.1", "3.2"])
def test_conversations_match_the_template(release, checkpoints):
    path, hf = checkpoints[release]
    tok = load_tokenizer(path)
    assert tok.dated_system_turn and tok.chat_template_source == path / "tokenizer_config.json"
    for name, messages in CASES.items():
        result = assert_matches(tok, hf, messages)
        replies = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        assert trained_text_runs(tok, result) == replies, name
        system = messages[0]["content"].strip() if messages[0]["role"] == "system" else ""
        assert tok.decode(result.tokens, skip_special_tokens=False).startswith(
            SYSTEM_TURN + system + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"), name
        # each prompt, up to a user turn, as the template's generation prompt
        for end, message in enumerate(messages):
            if message["role"] == "user":
                assert_matches(tok, hf, messages[:end + 1], add_generation_prompt=True)
    # the date is the date_string setting, as the template's date_string
    dated = load_tokenizer(path, date_string="01 Jan 2025")
    assert "Today Date: 01 Jan 2025\n" in dated.decode(assert_matches(dated, hf, CASES["system"],
                                                                      date_string="01 Jan 2025").tokens)


def test_the_checkpoint_template_decides(checkpoints, tmp_path):
    path, hf = checkpoints["3.0"]
    tok = load_tokenizer(path)  # Llama 3's template: Llama 3's format, as before
    assert not tok.dated_system_turn
    for messages in CASES.values():
        assert "Cutting Knowledge" not in tok.decode(assert_matches(tok, hf, messages).tokens)
    # The template as chat_template.jinja only (transformers' save_pretrained writes it so), then a Llama 3 template
    # there over a 3.1 one in tokenizer_config.json: the .jinja file wins, as transformers reads it.
    from transformers import AutoTokenizer

    for name, template, dated in (("jinja_only", (CHAT_TEMPLATES / "llama3_1.jinja").read_text(), True),
                                  ("jinja_wins", LLAMA3_CHAT_TEMPLATE, False)):
        model_dir = tmp_path / name
        shutil.copytree(checkpoints["3.1"][0], model_dir)
        if dated:  # tokenizer_config.json without its template
            config = model_dir / "tokenizer_config.json"
            config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
        (model_dir / "chat_template.jinja").write_text(template)
        tok = load_tokenizer(model_dir)
        assert (tok.dated_system_turn, tok.chat_template_source) == (dated, model_dir / "chat_template.jinja")
        assert_matches(tok, AutoTokenizer.from_pretrained(model_dir), CASES["system"])
    # a bare rank file: no template, Llama 3's format
    bare = tmp_path / "bare" / "tokenizer.model"
    bare.parent.mkdir()
    shutil.copy(checkpoints["3.1"][0] / "original" / "tokenizer.model", bare)
    tok = load_tokenizer(bare)
    assert (tok.dated_system_turn, tok.chat_template_source) == (False, None)


def test_date_header_forces_either_format(checkpoints):
    (path_30, hf_30), (path_32, hf_32) = checkpoints["3.0"], checkpoints["3.2"]
    always = load_tokenizer(path_30, date_header="always")  # Llama 3's template, the 3.2 template's format
    never = load_tokenizer(path_32, date_header="never")  # the 3.2 template, Llama 3's format
    for messages in CASES.values():
        assert_matches(always, hf_32, messages)
        assert_matches(never, hf_30, messages)
    # a tool-calling conversation has the template's system turn whatever the setting (Llama 3 has no tool format)
    assert (never.tokenize_messages(ONE_CALL, tools=TOOLS).tokens
            == load_tokenizer(path_32).tokenize_messages(ONE_CALL, tools=TOOLS).tokens)
    # the fingerprint follows the format: equal where the ids are (same rank file), apart where they are not
    auto_30, auto_32 = load_tokenizer(path_30), load_tokenizer(path_32)
    assert always.fingerprint() == auto_32.fingerprint() != auto_30.fingerprint() == never.fingerprint()
    for bad in ("yes", True, None):
        with pytest.raises(TokenizerError, match=r"^llama3 tokenizer: date_header must be one of auto, always, never, "
                                                 rf"got {bad!r}$"):
            load_tokenizer(path_30, date_header=bad)
