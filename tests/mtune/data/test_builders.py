"""Builders: labels are the tokenizer's own rendering, trained exactly on the answers; truncations are counted."""

import logging

import pytest

from mtune.data import IGNORE_INDEX, chat_dataset, instruct_dataset
from mtune.tokenizers import Message
from tests._helpers.data import ALPACA_ROWS, tiny_tokenizer, write_rows

CHATS = [
    [("system", "You are terse."), ("user", "Hi there"), ("assistant", "Hello."),
     ("user", "What is 2 and 3?"), ("assistant", "The sum is 5.")],
    [("user", "Name a colour"), ("assistant", "Blue"), ("user", "Another"), ("assistant", "Green, like grass.")],
]


def expected_labels(tok, messages):
    """Labels built independently of the tokenizer's `trained` mask: each assistant reply starts where the prefix
    rendered with a generation prompt ends, and is the reply's plain encoding followed by the end-of-turn token."""
    tokens = tok.tokenize_messages(messages, max_seq_len=10_000).tokens
    trained = [False] * len(tokens)
    for k, m in enumerate(messages):
        if m.role == "assistant":
            start = len(tok.tokenize_messages(messages[:k], max_seq_len=10_000, add_generation_prompt=True).tokens)
            reply = tok.encode(m.content, add_bos=False, add_eos=False) + [tok.end_of_turn_id]
            end = start + len(reply)
            assert tokens[start:end] == reply
            trained[start:end] = [True] * (end - start)
    return tokens, [tokens[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(tokens) - 1)] + [-100]


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def family_tok(request, tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp(request.param), request.param, max_seq_len=None)


def test_instruction_masking_is_exactly_the_answer(family_tok, tmp_path):
    path = write_rows(ALPACA_ROWS, tmp_path / "a.jsonl")
    ds = instruct_dataset(family_tok, str(path), system_prompt="Answer briefly.")
    for row, sample in zip(ALPACA_ROWS, (ds[i] for i in range(len(ds)))):
        user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        messages = [Message("system", "Answer briefly."), Message("user", user), Message("assistant", row["output"])]
        tokens, labels = expected_labels(family_tok, messages)
        assert sample == {"tokens": tokens, "labels": labels}


def test_multi_turn_chat_masking_openai_and_sharegpt(family_tok, tmp_path):
    openai = [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in CHATS]
    sharegpt_names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": sharegpt_names[r], "value": c} for r, c in chat]} for chat in CHATS]
    ds_openai = chat_dataset(family_tok, str(write_rows(openai, tmp_path / "o.jsonl")))
    ds_sharegpt = chat_dataset(family_tok, str(write_rows(sharegpt, tmp_path / "s.parquet")))
    for i, chat in enumerate(CHATS):
        tokens, labels = expected_labels(family_tok, [Message(r, c) for r, c in chat])
        assert ds_openai[i] == ds_sharegpt[i] == {"tokens": tokens, "labels": labels}
        assert sum(label != IGNORE_INDEX for label in labels) > 0


def test_train_on_input_and_column_map(tok, tmp_path):
    rows = [{"prompt": r["instruction"], "answer": r["output"]} for r in ALPACA_ROWS]
    ds = instruct_dataset(tok, str(write_rows(rows, tmp_path / "r.csv")), train_on_input=True,
                          column_map={"instruction": "prompt", "output": "answer"})
    sample = ds[0]
    assert sample["labels"] == sample["tokens"][1:] + [IGNORE_INDEX]
    assert sample["tokens"] == tok.tokenize_messages(
        [Message("user", rows[0]["prompt"]), Message("assistant", rows[0]["answer"])]).tokens


def test_truncations_are_counted_and_logged_once(tok, tmp_path, caplog):
    long_rows = [dict(r, output=r["output"] + " and so on" * 8 * (i % 2)) for i, r in enumerate(ALPACA_ROWS)]
    path = write_rows(long_rows, tmp_path / "long.jsonl")
    expected = sum(
        tok.tokenize_messages([Message("user", r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")),
                               Message("assistant", r["output"])], max_seq_len=40).truncated
        for r in long_rows
    )
    assert 0 < expected < len(long_rows)
    with caplog.at_level(logging.INFO, logger="mtune.data"):
        ds = instruct_dataset(tok, str(path), max_seq_len=40)
    assert ds.stats["truncated"] == expected and max(len(ds[i]["tokens"]) for i in range(len(ds))) == 40
    lines = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(lines) == 1 and f"{expected} truncated to max_seq_len=40" in lines[0]


def test_conversation_the_chat_format_refuses_names_the_row(tmp_path):
    from mtune.data import DataError

    llama2 = tiny_tokenizer(tmp_path, "llama2")
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}]
    with pytest.raises(DataError, match=r"c\.jsonl line 2: Llama 2 chat format: message 1 has role 'user'"):
        chat_dataset(llama2, str(write_rows(rows, tmp_path / "c.jsonl")))


def test_reasoning_of_openai_style_messages_reaches_the_formats_that_render_it(tmp_path):
    """A message's reasoning, under `thinking` (gpt-oss's data, e.g. HuggingFaceH4/Multilingual-Thinking, null on the
    other roles) or `reasoning_content` (Qwen's templates, OpenAI-compatible servers): gpt-oss's format renders the
    last reply's on the analysis channel, Qwen3.5's in the reply's thinking block, both trained; each sample equals
    tokenize_messages of the Message list with thinking given directly, whichever name the row used. A family whose
    template has no reasoning field (Llama 3) refuses the row, naming it and the family; a message with both names
    is refused. Mutations seen failing: the builder dropping thinking (the labels lose the analysis message); the
    builder reading `thinking` only (the Qwen3.5 sample loses its thinking block)."""
    from mtune.data import DataError

    gpt_oss = tiny_tokenizer(tmp_path, "gpt_oss", max_seq_len=None)
    chat = [{"role": "user", "content": "2 + 3?", "thinking": None},
            {"role": "assistant", "content": "5", "thinking": "add them"}]
    sample = chat_dataset(gpt_oss, str(write_rows([{"messages": chat}], tmp_path / "t.jsonl")))[0]
    messages = [Message("user", "2 + 3?"), Message("assistant", "5", thinking="add them")]
    expected = gpt_oss.tokenize_messages(messages)
    assert sample["tokens"] == expected.tokens
    trained = [t for t, label in zip(sample["tokens"][1:], sample["labels"]) if label != IGNORE_INDEX]
    assert gpt_oss.decode(trained, skip_special_tokens=False) == (
        "<|channel|>analysis<|message|>add them<|end|><|start|>assistant<|channel|>final<|message|>5<|return|>")
    qwen3_5 = tiny_tokenizer(tmp_path, "qwen3_5", max_seq_len=None)
    qwen_chat = [{"role": "user", "content": "2 + 3?", "reasoning_content": None},
                 {"role": "assistant", "content": "5", "reasoning_content": "add them"}]
    for name, rows in (("q", qwen_chat), ("g", chat)):  # either name, the same sample
        sample = chat_dataset(qwen3_5, str(write_rows([{"messages": rows}], tmp_path / f"{name}.jsonl")))[0]
        assert sample["tokens"] == qwen3_5.tokenize_messages(messages).tokens
        trained = [t for t, label in zip(sample["tokens"][1:], sample["labels"]) if label != IGNORE_INDEX]
        assert qwen3_5.decode(trained, skip_special_tokens=False) == "<think>\nadd them\n</think>\n\n5<|im_end|>"
    llama3 = tiny_tokenizer(tmp_path, "llama3")
    with pytest.raises(DataError, match=r"r\.jsonl line 1: llama3 chat format: a message has reasoning"):
        chat_dataset(llama3, str(write_rows([{"messages": qwen_chat}], tmp_path / "r.jsonl")))
    with pytest.raises(DataError, match=r"messages\[1\]: assistant message has both thinking and reasoning_content"):
        chat_dataset(qwen3_5, str(write_rows([{"messages": [chat[0], {**chat[1], "reasoning_content": "x"}]}],
                                             tmp_path / "b.jsonl")))
    with pytest.raises(DataError, match=r"messages\[1\]: thinking must be text, got int"):
        chat_dataset(gpt_oss, str(write_rows([{"messages": [chat[0], {**chat[1], "thinking": 3}]}],
                                             tmp_path / "n.jsonl")))


def test_tool_calling_rows_reach_the_formats_that_render_them(tmp_path):
    """OpenAI / Hugging Face tool-calling rows (a `tools` column, `tool_calls` with a null content, `tool` messages):
    gpt-oss's sample equals tokenize_messages of the same messages and tools, and trains the call and the answer; the
    tools also come from a mapped column holding their JSON text; a family without tool calling refuses the row,
    naming it and the family. Mutation seen failing: the builder not passing the row's tools (the ids lose the
    developer message's tool namespace)."""
    import json

    from mtune.data import DataError
    from tests._helpers.tool_calls import ONE_CALL, WEATHER

    gpt_oss = tiny_tokenizer(tmp_path, "gpt_oss", max_seq_len=None)
    messages = [m | {"content": None} if m.get("tool_calls") else m for m in ONE_CALL]
    path = write_rows([{"tools": [WEATHER], "messages": messages}], tmp_path / "tools.jsonl")
    sample = chat_dataset(gpt_oss, str(path))[0]
    expected = gpt_oss.tokenize_messages(ONE_CALL, tools=[WEATHER])
    assert sample["tokens"] == expected.tokens
    trained = [t for t, label in zip(sample["tokens"][1:], sample["labels"]) if label != IGNORE_INDEX]
    assert gpt_oss.decode(trained, skip_special_tokens=False) == (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
        "<|channel|>final<|message|>It is 18 °C and sunny in Paris.<|return|>")
    as_text = write_rows([{"functions": json.dumps([WEATHER]), "messages": messages}], tmp_path / "text.jsonl")
    assert chat_dataset(gpt_oss, str(as_text), column_map={"tools": "functions"})[0]["tokens"] == expected.tokens
    phi4 = tiny_tokenizer(tmp_path, "phi4_mini")
    with pytest.raises(DataError, match=r"tools\.jsonl line 1: phi4_mini chat format: the conversation uses tool call"):
        chat_dataset(phi4, str(path))
    bad = [messages[0], messages[1], {**messages[2], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(DataError, match=r"bad\.jsonl line 1: messages\[2\]: assistant message tool_calls\[0\] "
                                        "arguments is not valid JSON"):
        chat_dataset(gpt_oss, str(write_rows([{"messages": bad}], tmp_path / "bad.jsonl")))
