"""ShareGPT tool-calling rows (LLaMA-Factory's convention: ``function_call`` turns whose value is the calls' JSON
text, ``observation`` turns with the results, bare tool definitions as JSON text in a ``tools`` column) through
chat_dataset, against transformers' apply_chat_template on the equivalent OpenAI-format conversation with Qwen3's
official template (tests/assets/chat_templates/qwen3.jinja): the sample's ids equal the template's, and its labels are
the mask read off the template's text (every token of a reply, after ``<|im_start|>assistant\\n`` and up to its
``<|im_end|>``). Cases: one call, its result and the answer after a system turn; a ``gpt`` turn followed by a
``function_call`` of two parallel calls (one message with the text and both calls), two observations and the answer;
definitions given already wrapped. The same rows with Llama 3.1's template: the first equals the OpenAI form's ids,
the second is refused (Llama's template writes no text beside a call).

Mutations seen failing: observation mapped to a user turn (4 tests); the gpt turn kept as a message of its own
before the calls (2); bare definitions not wrapped (2: the tokenizer refuses them); a list value read as one call
(3).
"""

import json

import pytest

from mtune.data import DataError, chat_dataset
from mtune.data.common import IGNORE_INDEX
from mtune.tokenizers import load_tokenizer
from tests._helpers.data import write_rows
from tests._helpers.tokenizers import CHAT_TEMPLATES, write_llama3_tokenizer, write_qwen_tools_tokenizer
from tests._helpers.tool_calls import PARALLEL, SYSTEM, WEATHER, call, template_ids_and_mask

BARE_WEATHER = json.dumps([WEATHER["function"]])  # LLaMA-Factory's form: a list of bare definitions as JSON text
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
OSLO = {"name": "get_weather", "arguments": {"city": "Oslo"}}

ONE_CALL_ROW = {"tools": BARE_WEATHER, "conversations": [
    {"from": "system", "value": SYSTEM["content"]},
    {"from": "human", "value": "What's the weather in Paris?"},
    {"from": "function_call", "value": json.dumps(PARIS)},
    {"from": "observation", "value": '{"temperature": 18, "sky": "sunny"}'},
    {"from": "gpt", "value": "It is 18 °C and sunny in Paris."}]}
ONE_CALL_OPENAI = [SYSTEM, {"role": "user", "content": "What's the weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [call("get_weather", PARIS["arguments"])]},
                   {"role": "tool", "content": '{"temperature": 18, "sky": "sunny"}'},
                   {"role": "assistant", "content": "It is 18 °C and sunny in Paris."}]
# a gpt turn right before the function_call: the same assistant turn's text (PARALLEL is its OpenAI form)
TEXT_AND_CALLS_ROW = {"tools": [WEATHER], "conversations": [
    {"from": "human", "value": "Weather in Paris and in Oslo?"}, {"from": "gpt", "value": "I'll check both."},
    {"from": "function_call", "value": json.dumps([PARIS, OSLO])},
    {"from": "observation", "value": "18 °C"}, {"from": "observation", "value": "9 °C"},
    {"from": "gpt", "value": "Paris 18 °C, Oslo 9 °C."}]}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen3_tools")
    write_qwen_tools_tokenizer(path, "qwen3")
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


def trained_of(sample) -> list[bool]:
    """The trained mask behind a sample's shifted labels (the first token is never trained)."""
    return [False] + [label != IGNORE_INDEX for label in sample["labels"][:-1]]


@pytest.mark.parametrize("name", ["one_call", "text_and_calls", "wrapped"])
def test_sharegpt_tool_rows_equal_the_template_on_their_openai_form(name, qwen3, tmp_path):
    tok, hf = qwen3
    row, openai, tools = {"one_call": (ONE_CALL_ROW, ONE_CALL_OPENAI, [WEATHER]),
                          "text_and_calls": (TEXT_AND_CALLS_ROW, PARALLEL, [WEATHER]),
                          "wrapped": (ONE_CALL_ROW | {"tools": json.dumps([WEATHER])}, ONE_CALL_OPENAI,
                                      [WEATHER])}[name]
    sample = chat_dataset(tok, str(write_rows([row], tmp_path / "rows.jsonl")))[0]
    ids, mask = template_ids_and_mask(hf, openai, tools, "<|im_start|>assistant\n", "<|im_end|>")
    assert sample["tokens"] == ids
    assert trained_of(sample) == mask
    if name == "text_and_calls":
        text = tok.decode(sample["tokens"], skip_special_tokens=False)
        reply = text.split("<|im_start|>assistant\n")[1]
        assert reply.startswith("I'll check both.\n<tool_call>") and reply.count("<tool_call>") == 2


def test_llama3_takes_the_calls_and_refuses_text_beside_them(tmp_path):
    path = tmp_path / "llama"
    write_llama3_tokenizer(path, release="3.1", chat_template=(CHAT_TEMPLATES / "llama3_1.jinja").read_text())
    tok = load_tokenizer(path)
    sample = chat_dataset(tok, str(write_rows([ONE_CALL_ROW], tmp_path / "one.jsonl")))[0]
    assert sample["tokens"] == tok.tokenize_messages(ONE_CALL_OPENAI, tools=[WEATHER]).tokens
    only_calls = TEXT_AND_CALLS_ROW | {"conversations": TEXT_AND_CALLS_ROW["conversations"][:1]
                                       + [{"from": "function_call", "value": json.dumps(PARIS)}]}
    chat_dataset(tok, str(write_rows([only_calls], tmp_path / "calls.jsonl")))
    with pytest.raises(DataError, match=r"two\.jsonl line 1: llama3 chat format: message 1 makes 2 tool calls"):
        chat_dataset(tok, str(write_rows([TEXT_AND_CALLS_ROW], tmp_path / "two.jsonl")))
    # Llama 3.1's own name for a tool result, ipython, reads as tool (Meta's template takes either)
    ipython = [dict(m, role="ipython") if m["role"] == "tool" else m for m in ONE_CALL_OPENAI]
    sample = chat_dataset(tok, str(write_rows([{"messages": ipython, "tools": [WEATHER]}], tmp_path / "ip.jsonl")))[0]
    assert sample["tokens"] == tok.tokenize_messages(ONE_CALL_OPENAI, tools=[WEATHER]).tokens


@pytest.mark.parametrize("value, tools, error", [
    ("get_weather(city='Paris')", BARE_WEATHER,
     r"conversations\[2\]: a function_call value must be the JSON text of a \{\"name\", \"arguments\"\} object or a "
     r"list of them; it is not valid JSON"),
    ('{"arguments": {"city": "Paris"}}', BARE_WEATHER,
     r"conversations\[2\]: function_call\[0\]: a tool call needs function.name"),
    ("[]", BARE_WEATHER, r"conversations\[2\]: a function_call value names no call"),
    ('{"name": "get_weather", "arguments": "{city"}', BARE_WEATHER,
     r"conversations\[2\]: function_call\[0\] arguments is not valid JSON"),
    (json.dumps(PARIS), "[{", r"column 'tools' is not valid JSON"),
], ids=["not_json", "no_name", "no_call", "bad_arguments", "bad_tools"])
def test_bad_sharegpt_tool_rows_are_refused_in_one_line(value, tools, error, qwen3, tmp_path):
    conversation = [dict(m) for m in ONE_CALL_ROW["conversations"]]
    conversation[2]["value"] = value
    path = write_rows([{"tools": tools, "conversations": conversation}], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl line 1: " + error) as raised:
        chat_dataset(qwen3[0], str(path))
    assert "\n" not in str(raised.value)


def test_a_system_column_is_the_rows_system_turn(qwen3, tmp_path):
    """LLaMA-Factory's separate ``system`` column: the row's system message where its conversation opens with none
    (ids and mask equal the template's on the conversation with that system turn); the conversation's own system turn
    wins, as in LLaMA-Factory; ``column_map`` names another column; ``system_prompt`` replaces it; a value other than
    text is refused naming the row and the column. Mutation seen failing: the column not read (the system turn
    missing)."""
    tok, hf = qwen3
    turns = ONE_CALL_ROW["conversations"][1:]  # no system turn of its own
    ids, mask = template_ids_and_mask(hf, ONE_CALL_OPENAI, [WEATHER], "<|im_start|>assistant\n", "<|im_end|>")

    def first(rows, name, **kwargs):
        return chat_dataset(tok, str(write_rows(rows, tmp_path / f"{name}.jsonl")), **kwargs)[0]

    sample = first([{"tools": BARE_WEATHER, "system": SYSTEM["content"], "conversations": turns}], "column")
    assert sample["tokens"] == ids and trained_of(sample) == mask
    own = {"tools": BARE_WEATHER, "system": "Not this one.", "conversations": ONE_CALL_ROW["conversations"]}
    assert first([own], "own")["tokens"] == ids
    renamed = {"tools": BARE_WEATHER, "sys": SYSTEM["content"], "conversations": turns}
    assert first([renamed], "renamed", column_map={"system": "sys"})["tokens"] == ids
    replaced = first([{"tools": BARE_WEATHER, "system": SYSTEM["content"], "conversations": turns}], "replaced",
                     system_prompt="Be brief.")
    text = tok.decode(replaced["tokens"], skip_special_tokens=False)
    assert "Be brief." in text and SYSTEM["content"] not in text
    with pytest.raises(DataError, match=r"bad_system\.jsonl line 1: column 'system' must be text, got int"):
        first([{"system": 3, "conversations": turns}], "bad_system")


def test_system_prompt_replaces_the_conversations_system_turns_and_empty_values_add_none():
    """``system_prompt`` replaces a conversation's own system turn (it is not kept beside it); an empty system
    column adds no system turn; a message without content (and no calls) is refused, not read as empty text."""
    from mtune.data.messages import conversation_messages, with_row_system
    from mtune.data.tokenized import RowError
    from mtune.tokenizers import Message

    conversation = [{"role": "system", "content": "Old."}, {"role": "user", "content": "hi"}]
    assert conversation_messages(conversation, "messages", system_prompt="New.") == [
        Message("system", "New."), Message("user", "hi")]
    assert with_row_system([Message("user", "hi")], "", "system") == [Message("user", "hi")]
    with pytest.raises(RowError, match=r"^messages\[1\]: content must be text, got NoneType$"):
        conversation_messages([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages")
