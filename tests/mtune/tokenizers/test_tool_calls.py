"""Tool-calling conversations against the official templates run by transformers' apply_chat_template(...,
tools=...): gpt-oss (tests/assets/chat_templates/gpt_oss.jinja, the checkpoints' template with its tool macros),
Qwen3 and Qwen3.5 (their full templates, on tiny tokenizer.json files that have the four tool tags as tokens, as
the hub's do). Ids equal transformers' for: one call, its result and the answer; two parallel calls (Qwen; gpt-oss
takes them one per message); a tool with nested JSON-schema parameters (gpt-oss's TypeScript rendering of arrays,
enums, optional fields, defaults, descriptions, oneOf); arguments given as JSON text. The trained tokens are
checked as text: what the model writes (calls included), never the tool definitions or results.

Mutations seen failing: gpt-oss's nested-object whitespace written without the template's newline and 16 spaces
(3 tests); "?" written on required parameters; integer arrays written as ``integer[]`` (not ``number[]``); the
tool result's content not JSON-quoted; the analysis message kept before a call that a final answer follows; tool
calls not trained; tool results trained; Qwen3's newline before the first call written without text before it;
Qwen3.5's boolean arguments written as JSON (``true``) instead of Python text (``True``); the Qwen tool tags encoded
as text instead of their tokens; the consecutive tool results each opening a user turn; ChatBuilder flagging a
mixed run by its last piece (9 tokenizer tests).
"""

import datetime

import pytest

from mtune.tokenizers import Message, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from mtune.tokenizers.gpt_oss import DEFAULT_DATE
from mtune.tokenizers.gpt_oss_tools import tool_namespace
from mtune.tokenizers.tools import ToolCall
from tests._helpers.tokenizers import CONVERSATIONS, trained_text_runs, write_qwen_tools_tokenizer
from tests._helpers.tool_calls import (NESTED, ONE_CALL, PARALLEL, SEARCH, SEQUENTIAL, TOOLS, WEATHER, call,
                                       with_string_arguments)

QWEN = ("qwen3", "qwen3_5")
PARIS_ARGS = {"city": "Paris", "unit": "celsius"}
PARIS_CALL = call("get_weather", PARIS_ARGS)


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_tools")
    for family in QWEN:
        write_qwen_tools_tokenizer(root / family, family)
    return {family: root / family for family in QWEN}


@pytest.fixture
def tokenizers(tokenizer_dirs, hf_tokenizers, qwen_dirs, monkeypatch):
    """{family: (mtune tokenizer, transformers tokenizer)}; gpt-oss's template's date pinned to DEFAULT_DATE."""
    import transformers.utils.chat_template_utils as chat_utils
    from transformers import AutoTokenizer

    day = datetime.date.fromisoformat(DEFAULT_DATE)

    class Today(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(day.year, day.month, day.day)

    monkeypatch.setattr(chat_utils, "datetime", Today)
    pairs = {f: (load_tokenizer(d), AutoTokenizer.from_pretrained(d)) for f, d in qwen_dirs.items()}
    return pairs | {"gpt_oss": (load_tokenizer(tokenizer_dirs["gpt_oss"]), hf_tokenizers["gpt_oss"])}


def hf_ids(hf, messages, tools, **kwargs):
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    return hf(text, add_special_tokens=False)["input_ids"]


QWEN3_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
QWEN3_5_PARIS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                 "celsius\n</parameter>\n</function>\n</tool_call>")
EMPTY_THINK = "<think>\n\n</think>\n\n"
ONE_CALL_TRAINED = {
    "gpt_oss": [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}'
                "<|call|>", "<|channel|>final<|message|>It is 18 °C and sunny in Paris.<|return|>"],
    "qwen3": [QWEN3_PARIS + "<|im_end|>", EMPTY_THINK + "It is 18 °C and sunny in Paris.<|im_end|>"],
    "qwen3_5": [EMPTY_THINK + QWEN3_5_PARIS + "<|im_end|>", EMPTY_THINK + "It is 18 °C and sunny in Paris.<|im_end|>"],
}


@pytest.mark.parametrize("family", ["gpt_oss", *QWEN])
def test_one_call_its_result_and_the_answer(family, tokenizers):
    tok, hf = tokenizers[family]
    result = tok.tokenize_messages(ONE_CALL, tools=TOOLS)
    assert result.tokens == hf_ids(hf, ONE_CALL, TOOLS)
    assert trained_text_runs(tok, result) == ONE_CALL_TRAINED[family]
    # the conversation so far, awaiting the answer: the same ids as the template's generation prompt
    prompt = tok.tokenize_messages([Message(**m) for m in ONE_CALL[:4]], tools=TOOLS, add_generation_prompt=True)
    assert prompt.tokens == hf_ids(hf, ONE_CALL[:4], TOOLS, add_generation_prompt=True)
    direct = ONE_CALL[:2] + [{"role": "assistant", "content": "I can't tell."}]  # tools offered, none called
    assert tok.tokenize_messages(direct, tools=TOOLS).tokens == hf_ids(hf, direct, TOOLS)
    if family != "gpt_oss":  # the template's own tags are the tokenizer's tokens
        assert hf.convert_tokens_to_ids("<tool_call>") in result.tokens
        assert hf.convert_tokens_to_ids("<tool_response>") in result.tokens


@pytest.mark.parametrize("family", QWEN)
def test_two_parallel_calls_and_their_results(family, tokenizers):
    tok, hf = tokenizers[family]
    result = tok.tokenize_messages(PARALLEL, tools=[WEATHER])
    assert result.tokens == hf_ids(hf, PARALLEL, [WEATHER])
    calls = trained_text_runs(tok, result)[0]
    assert calls.count("<tool_call>") == 2 and "Oslo" in calls and calls.endswith("</tool_call><|im_end|>")
    user_turns = tok.decode(result.tokens, skip_special_tokens=False).split("<|im_start|>user")
    assert len(user_turns) == 3 and user_turns[2].count("<tool_response>") == 2  # both results in one user turn


def test_gpt_oss_takes_calls_one_per_message(tokenizers):
    tok, hf = tokenizers["gpt_oss"]
    result = tok.tokenize_messages(SEQUENTIAL, tools=[WEATHER])
    assert result.tokens == hf_ids(hf, SEQUENTIAL, [WEATHER])
    text = tok.decode(result.tokens, skip_special_tokens=False)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"9 °C\"<|end|>" in text
    assert "now Oslo" not in text  # a call's analysis is dropped when a final answer follows ...
    unanswered = tok.tokenize_messages(SEQUENTIAL[:4], tools=[WEATHER])  # ... and kept when none does
    assert unanswered.tokens == hf_ids(hf, SEQUENTIAL[:4], [WEATHER])
    assert trained_text_runs(tok, unanswered)[-1].startswith("<|channel|>analysis<|message|>now Oslo<|end|><|start|>"
                                                        "assistant to=functions.get_weather")
    # two calls in one message: the template renders the first only; mtune refuses rather than drop the second
    with pytest.raises(TokenizerError, match="message 1 makes 2 tool calls; harmony has one call per assistant"):
        tok.tokenize_messages(PARALLEL, tools=[WEATHER])
    with pytest.raises(TokenizerError, match="message 1 is a tool message, but no assistant message before it"):
        tok.tokenize_messages([PARALLEL[0], PARALLEL[2]], tools=[WEATHER])
    with pytest.raises(TokenizerError, match="message 2 is the result of tool 'now', but the call before it is"):
        tok.tokenize_messages(SEQUENTIAL[:2] + [SEQUENTIAL[2] | {"name": "now"}], tools=[WEATHER])


@pytest.mark.parametrize("family", ["gpt_oss", *QWEN])
def test_nested_schema_and_arguments(family, tokenizers):
    tok, hf = tokenizers[family]
    result = tok.tokenize_messages(NESTED, tools=TOOLS)
    assert result.tokens == hf_ids(hf, NESTED, TOOLS)
    assert "Ana" in trained_text_runs(tok, result)[0]


def test_gpt_oss_typescript_namespace():
    """The developer message's tool block, spelled out for the flight search tool (the test above checks it against
    the template): types, "?" on optional parameters, defaults, descriptions, and the template's whitespace."""
    assert tool_namespace([SEARCH]) == (
        "## functions\n\nnamespace functions {\n\n// Finds flights.\ntype search_flights = (_: {\n"
        "// IATA code.\norigin: string,\n"
        'cabin?: "economy" | "business", // default: economy,\n'
        "max_stops?: number, // default: 1,\n"
        "// Allowed airlines.\nairlines?: string[],\n"
        "seats?: number[],\n"
        "legs?: number[][],\n"
        "passengers: any[],\n"
        "filters?: {\nrefundable: " + "\n" + " " * 16 + "boolean, window?: " + "\n" + " " * 16 + "{\nearliest?: "
        + "\n" + " " * 16 + "string | null}},\n"
        "date?: string | null,\n"
        "budget?: number// in euros | \nstring" + " " * 20 + '// default: "any",\n'
        "notes?: any,\n"
        "}) => any;\n\n} // namespace functions")


@pytest.mark.parametrize("family", ["gpt_oss", *QWEN])
def test_arguments_given_as_json_text(family, tokenizers):
    """OpenAI's API gives arguments as JSON text. Qwen3's template writes such text verbatim (mtune too); gpt-oss's
    would write it as a JSON string and Qwen3.5's raises (``|items`` on a string): mtune writes the object, as both
    do for a dict. (The Qwen3.5 raise also pins the asset to the official template: a patched copy that writes no
    parameters for text instead, once used here, fails this test.)"""
    tok, hf = tokenizers[family]
    text_args = with_string_arguments(ONE_CALL)
    if family == "qwen3_5":
        with pytest.raises(TypeError, match="Can only get item pairs from a mapping"):
            hf_ids(hf, text_args, [WEATHER])
    result = tok.tokenize_messages(text_args, tools=[WEATHER])
    assert result.tokens == hf_ids(hf, text_args if family == "qwen3" else ONE_CALL, [WEATHER])
    if family == "qwen3":
        assert '"arguments": {"city":"Paris","unit":"celsius"}}' in trained_text_runs(tok, result)[0]
    compact = '{"city":"Paris","unit":"celsius"}'
    assert Message(**text_args[2]).tool_calls == (ToolCall("get_weather", PARIS_ARGS, compact),)


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_conversations_without_tools_still_match_the_full_template(family, name, tokenizers):
    tok, hf = tokenizers[family]
    messages = [{"role": role, "content": content} for role, content in CONVERSATIONS[name]]
    if family == "qwen3_5":
        messages = [m | {"content": m["content"].strip()} if m["role"] == "system" else m for m in messages]
    assert tok.tokenize_messages(messages).tokens == hf_ids(hf, messages, None)


def test_bad_tool_data_is_refused_in_one_line(tokenizer_dirs, tokenizers):
    phi4 = load_tokenizer(tokenizer_dirs["phi4_mini"])
    with pytest.raises(TokenizerError, match="^phi4_mini chat format: the conversation uses tool calling"):
        phi4.tokenize_messages(ONE_CALL)
    with pytest.raises(TokenizerError, match="^phi4_mini chat format: the conversation uses tool calling"):
        phi4.tokenize_messages(ONE_CALL[:2], tools=[WEATHER])
    with pytest.raises(ValueError, match=r"assistant message tool_calls\[0\] arguments is not valid JSON"):
        Message("assistant", "", tool_calls=[call("f", "{city: Paris}")])
    with pytest.raises(ValueError, match=r"tool_calls\[0\] arguments must be a JSON object .* got list"):
        Message("assistant", "", tool_calls=[call("f", [1, 2])])
    with pytest.raises(ValueError, match="tool_calls are only read on assistant messages, got them on a user"):
        Message("user", "hi", tool_calls=[PARIS_CALL])
    with pytest.raises(ValueError, match=r"tools\[0\] must be \{\"type\": \"function\""):
        tokenizers["qwen3"][0].tokenize_messages(ONE_CALL, tools=[{"name": "get_weather"}])
    no_description = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(ValueError, match="gpt_oss chat format: tool 'f' has no description"):
        tokenizers["gpt_oss"][0].tokenize_messages(ONE_CALL, tools=[no_description])
