"""Llama 3.1 / 3.2 / 3.3 tool calling against Meta's official templates run by transformers' apply_chat_template(...,
tools=...): tests/assets/chat_templates/llama3_1.jinja (Llama 3.1's, byte-identical to Llama 3.3's) and
llama3_2.jinja (Llama 3.2's, which writes the day it runs: ``strftime_now`` is pinned to 26 Jul 2024 here), on the
tiny Llama 3 rank file and its tokenizer.json. Ids equal transformers', and the trained mask equals the one read off
the template's text (a token is trained when it starts inside an assistant turn's body, after its header and up to
its ``<|eot_id|>``). Cases: one call, its result and the answer, with a system message; nested parameters and no
system message; arguments given as JSON text; a conversation continued after a second call; tools in the system
turn (``tools_in_user_message=False``); another date; calls with no tool definitions.

Mutations seen failing: the tool result written as its text instead of its JSON string (8 tests); the
"Environment: ipython" line written without tools (2); the tool definitions' indent 4 dropped (8); the
``<|eot_id|>`` of a turn not trained (8); the first user message not trimmed (2, the spaced case).
"""

import pytest

from mtune.tokenizers import Message, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from tests._helpers.tokenizers import (CHAT_TEMPLATES, pin_template_day, trained_text_runs,
                                      write_llama3_tokenizer)
from tests._helpers.tool_calls import (NESTED, ONE_CALL, PARALLEL, QUESTION, TOOLS, WEATHER, call, template_ids_and_mask,
                                       with_string_arguments)

RELEASES = ("3.1", "3.2")
REPLY_OPEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"
PARIS_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>'
# Two calls one after the other, each answered, then the reply; the user's message padded with spaces (trimmed).
TWO_STEPS = [QUESTION | {"content": "  Weather in Paris and in Oslo?\n"},
             {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"})]},
             {"role": "tool", "content": "18 °C"},
             {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
             {"role": "tool", "content": '{"c": 9}'},
             {"role": "assistant", "content": " Paris 18 °C, Oslo 9 °C. "}]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{release: (mtune tokenizer, transformers tokenizer)} over the release's official template."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama3_tools")
    out = {}
    for release in RELEASES:
        template = (CHAT_TEMPLATES / f"llama3_{release[-1]}.jinja").read_text()
        write_llama3_tokenizer(root / release, release=release, chat_template=template)
        out[release] = (load_tokenizer(root / release), AutoTokenizer.from_pretrained(root / release))
    return out


@pytest.fixture(autouse=True)
def pinned_day(monkeypatch):
    """Llama 3.2's template writes strftime_now("%d %b %Y"): make that 26 Jul 2024, the 3.1 template's date."""
    pin_template_day(monkeypatch)


def assert_matches(tok, hf, messages, tools, template_messages=None, **kwargs):
    result = tok.tokenize_messages(messages, tools=tools, add_generation_prompt=kwargs.get("add_generation_prompt",
                                                                                          False))
    ids, mask = template_ids_and_mask(hf, template_messages or messages, tools, REPLY_OPEN, "<|eot_id|>", **kwargs)
    assert result.tokens == ids
    assert result.trained == mask
    return result


@pytest.mark.parametrize("release", RELEASES)
def test_one_call_its_result_and_the_answer(release, pairs):
    tok, hf = pairs[release]
    result = assert_matches(tok, hf, ONE_CALL, TOOLS)
    assert trained_text_runs(tok, result) == [PARIS_CALL, "It is 18 °C and sunny in Paris.<|eot_id|>"]
    text = tok.decode(result.tokens, skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nAnswer with the tools' "
                           "data.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions")
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 18' in text  # the result, as JSON
    # awaiting the answer: the template's generation prompt
    assert_matches(tok, hf, ONE_CALL[:4], TOOLS, add_generation_prompt=True)
    direct = ONE_CALL[:2] + [{"role": "assistant", "content": "I can't tell."}]  # tools offered, none called
    assert_matches(tok, hf, direct, TOOLS)


@pytest.mark.parametrize("release", RELEASES)
def test_nested_parameters_two_steps_and_no_system_message(release, pairs):
    tok, hf = pairs[release]
    result = assert_matches(tok, hf, NESTED, TOOLS)
    assert '"passengers": [{"age": 34, "name": "Ana"}], "filters": {"refundable": true}' in trained_text_runs(
        tok, result)[0]
    result = assert_matches(tok, hf, TWO_STEPS, [WEATHER])
    assert trained_text_runs(tok, result)[-1] == "Paris 18 °C, Oslo 9 °C.<|eot_id|>"


@pytest.mark.parametrize("release", RELEASES)
def test_arguments_given_as_json_text(release, pairs):
    """OpenAI's API gives arguments as JSON text; the template would write that text as a JSON string
    (``"parameters": "{\\"city\\"..."``). mtune writes the object, as the template writes the dict."""
    tok, hf = pairs[release]
    text_args = with_string_arguments(ONE_CALL)
    assert '"parameters": "{\\"city' in hf.apply_chat_template(text_args, tools=[WEATHER], tokenize=False)
    result = assert_matches(tok, hf, text_args, [WEATHER], template_messages=ONE_CALL)
    assert trained_text_runs(tok, result)[0] == PARIS_CALL


@pytest.mark.parametrize("release", RELEASES)
def test_settings_and_calls_without_tools(release, pairs, tmp_path):
    tok, hf = pairs[release]
    path = tok.files[0].parent.parent
    in_system = load_tokenizer(path, tools_in_user_message=False)
    result = assert_matches(in_system, hf, ONE_CALL, TOOLS, tools_in_user_message=False)
    assert "You have access to the following functions." in in_system.decode(result.tokens)
    dated = load_tokenizer(path, date_string="01 Jan 2025")
    assert_matches(dated, hf, ONE_CALL, [WEATHER], date_string="01 Jan 2025")
    assert len({tok.fingerprint(), in_system.fingerprint(), dated.fingerprint()}) == 3
    # calls and results with no tool definitions: the system turn without "Environment: ipython"
    result = assert_matches(tok, hf, ONE_CALL, None)
    assert "Environment" not in tok.decode(result.tokens)
    # a conversation without tool calling: the template's system turn too, these checkpoints' templates having it
    # (test_llama31_chat.py)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert_matches(tok, hf, plain, None)


def test_what_the_template_cannot_render_is_refused(pairs):
    tok, hf = pairs["3.1"]
    with pytest.raises(Exception, match="This model only supports single tool-calls at once"):
        hf.apply_chat_template(PARALLEL, tools=[WEATHER], tokenize=False)
    with pytest.raises(TokenizerError, match="^llama3 chat format: message 1 makes 2 tool calls; the Llama 3.1"):
        tok.tokenize_messages(PARALLEL, tools=[WEATHER])
    with_text = PARALLEL[:1] + [PARALLEL[1] | {"tool_calls": PARALLEL[1]["tool_calls"][:1]}]
    with pytest.raises(TokenizerError, match="^llama3 chat format: message 1 has text beside its tool call"):
        tok.tokenize_messages(with_text, tools=[WEATHER])
    with pytest.raises(TokenizerError, match="first after the system message, but message 1 has role 'assistant'"):
        tok.tokenize_messages([ONE_CALL[0]] + ONE_CALL[2:], tools=[WEATHER])
    with pytest.raises(TokenizerError, match="first after the system message, but none is"):
        tok.tokenize_messages([ONE_CALL[0]], tools=[WEATHER])
    with pytest.raises(TokenizerError, match="date_string must be non-empty text"):
        load_tokenizer(tok.files[0].parent.parent, date_string="")
    assert Message("assistant", None, tool_calls=[call("f", {})]).content == ""
