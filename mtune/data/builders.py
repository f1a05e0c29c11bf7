"""Dataset builders: the `_component_`s a config's `dataset:` node names, called as
`instantiate(cfg.dataset, tokenizer=tok)`.

Each reads rows with `load_source`, turns a row into chat messages (or plain text), tokenizes every row up front
with the tokenizer's own chat format and returns a `TokenizedDataset`. Common arguments:

- `source`, `data_files`, `split`, `revision`, `load_dataset_kwargs`: where the rows come from (see
  `mtune.data.sources.load_source`); `load_dataset_kwargs` is passed on to `datasets.load_dataset` for hub
  datasets (e.g. `{name: wikitext-2-raw-v1}`) and is the only pass-through: any other key is refused by name;
- `column_map`: `{builder's column name: the data's column name}`, e.g. `{instruction: prompt, output: answer}`;
- `train_on_input` (default false): when false only assistant replies are trained on;
- `max_seq_len`: truncation / pack length (default: the tokenizer's `max_seq_len`);
- `packed`: pack samples into sequences of `max_seq_len` (see `mtune.data.packing`);
- `cache`: keep the tokenized result on disk for the next run (default true).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from mtune.data.common import IGNORE_INDEX, DataError
from mtune.data.sources import load_source
from mtune.data.tokenized import MissingColumn, RowError, TokenizedDataset, build_tokenized, labels_from_mask
from mtune.data.messages import conversation_messages, row_tools, with_row_system
from mtune.tokenizers.base import Message


def instruct_dataset(
    tokenizer,
    source: str,
    *,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    train_on_input: bool = False,
    max_seq_len: int | None = None,
    packed: bool = False,
    cache: bool = True,
    data_files: Any = None,
    split: str = "train",
    revision: str | None = None,
    load_dataset_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedDataset:
    """Instruction data (Alpaca columns `instruction`, `input` (optional), `output` by default).

    Each row becomes a user message (`instruction`, then a blank line and `input` when it is not empty) and an
    assistant message (`output`), after an optional system message `system_prompt`.
    """
    columns = _column_map(column_map, ("instruction", "input", "output"))
    max_seq_len = _checked_max_seq_len(system_prompt, max_seq_len, tokenizer)

    def to_messages(row: dict[str, Any]) -> list[tuple[str, str]]:
        _mapped_columns(row, columns, column_map, "input")
        instruction = _text(row, columns, "instruction")
        extra = _text(row, columns, "input", required=False)
        output = _text(row, columns, "output")
        if not output.strip():  # an answer of nothing would train the reply to end at once
            raise RowError(f"column {columns['output']!r} is empty text: every row needs its output")
        messages = [("system", system_prompt)] if system_prompt else []
        messages.append(("user", f"{instruction}\n\n{extra}" if extra else instruction))
        messages.append(("assistant", output))
        return messages

    settings = {"columns": columns, "system_prompt": system_prompt, "train_on_input": train_on_input}
    source_rows = load_source(source, data_files, split, revision, load_dataset_kwargs=load_dataset_kwargs)
    convert = _chat_converter(tokenizer, to_messages, train_on_input, max_seq_len)
    return build_tokenized(
        tokenizer, source_rows, convert, name="instruct", settings=settings, max_seq_len=max_seq_len,
        packed=packed, cache=cache,
    )


def alpaca_dataset(tokenizer, source: str = "tatsu-lab/alpaca", **kwargs: Any) -> TokenizedDataset:
    """The Alpaca data set (or any file with its columns): `instruct_dataset` with the hub's `tatsu-lab/alpaca`
    as the default source; it takes exactly `instruct_dataset`'s keyword arguments."""
    return instruct_dataset(tokenizer, source, **kwargs)


# Config checks read this signature: instruct_dataset's own, so a misspelt key is refused, not swallowed.
alpaca_dataset.__signature__ = inspect.signature(instruct_dataset).replace(parameters=[
    p.replace(default="tatsu-lab/alpaca") if p.name == "source" else p
    for p in inspect.signature(instruct_dataset).parameters.values()])


def chat_dataset(
    tokenizer,
    source: str,
    *,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    train_on_input: bool = False,
    max_seq_len: int | None = None,
    packed: bool = False,
    cache: bool = True,
    data_files: Any = None,
    split: str = "train",
    revision: str | None = None,
    load_dataset_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedDataset:
    """Multi-turn conversations, OpenAI style (a `messages` column of `{role, content}` with roles system / user /
    assistant / tool) or ShareGPT style (a `conversations` column of `{from, value}` with human / gpt / system, and
    the tool roles function_call / observation, see :mod:`mtune.data.messages`).
    An OpenAI-style assistant message's reasoning, under `thinking` (gpt-oss's data) or `reasoning_content` (Qwen's
    templates, OpenAI-compatible servers), goes to the chat formats that render it (gpt-oss's analysis channel,
    Qwen3's and Qwen3.5's thinking block); the other families refuse such a row, naming it and the family.

    Tool calling, OpenAI / Hugging Face style: an assistant message's `tool_calls` (content may be null), `tool`
    messages with the results (`name`, `tool_call_id` optional) and the row's `tools` column (the tool definitions,
    a list or its JSON text; `column_map: {tools: <column>}` names another) go to the chat formats that render them
    (Llama 3.1+, gpt-oss, Qwen3, Qwen3.5); the other families refuse such a row, naming it and the family. ShareGPT
    rows call tools with `function_call` turns and answer with `observation` turns; their `tools` may be bare
    `{name, description, parameters}` definitions (LLaMA-Factory's form), which are wrapped in OpenAI's.

    The column is found by name (`messages`, else `conversations`; `column_map: {messages: <column>}` names
    another); each message's style is recognised by its keys. A row's `system` column (LLaMA-Factory's, text;
    `column_map: {system: <column>}` names another) is its system message where the conversation opens with none.
    `system_prompt` replaces the data's system messages, the column's too.
    """
    columns = _column_map(column_map, ("messages", "conversations", "tools", "system"))
    max_seq_len = _checked_max_seq_len(system_prompt, max_seq_len, tokenizer)

    def conversation_column(row: dict[str, Any]) -> str:
        # The column the user mapped, else whichever of `messages` / `conversations` the row has.
        mapped = [name for name in ("messages", "conversations") if name in (column_map or {})]
        found = mapped or [name for name in ("messages", "conversations") if row.get(name) is not None]
        column = columns[found[0]] if found else "messages"
        if row.get(column) is None:
            raise MissingColumn(found[0] if found else "messages", column)
        return column

    def to_messages(row: dict[str, Any]) -> list[Message]:
        _mapped_columns(row, columns, column_map, "system", "tools")
        column = conversation_column(row)
        messages = conversation_messages(row[column], column, system_prompt)
        replies = [m for m in messages if m.role == "assistant"]
        for k, reply in enumerate(replies, 1):  # one of nothing would train the reply to end at once
            if not reply.content.strip() and not reply.tool_calls and not (reply.thinking or "").strip():
                raise RowError(f"column {column!r}: assistant reply {k} of {len(replies)} is empty (no text, tool "
                               "calls or reasoning); fill it in or drop the row")
        return messages if system_prompt else with_row_system(messages, row.get(columns["system"]), columns["system"])

    def to_tools(row: dict[str, Any]) -> Any:
        return row_tools(row.get(columns["tools"]), columns["tools"], row[conversation_column(row)])

    settings = {"columns": columns, "column_map": column_map, "system_prompt": system_prompt,
                "train_on_input": train_on_input}
    source_rows = load_source(source, data_files, split, revision, load_dataset_kwargs=load_dataset_kwargs)
    convert = _chat_converter(tokenizer, to_messages, train_on_input, max_seq_len, to_tools)
    return build_tokenized(
        tokenizer, source_rows, convert, name="chat", settings=settings, max_seq_len=max_seq_len,
        packed=packed, cache=cache,
    )


def text_completion_dataset(
    tokenizer,
    source: str,
    *,
    column_map: dict[str, str] | None = None,
    add_eos: bool = True,
    max_seq_len: int | None = None,
    packed: bool = False,
    cache: bool = True,
    data_files: Any = None,
    split: str = "train",
    revision: str | None = None,
    sample_by: str = "line",
    load_dataset_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedDataset:
    """Plain text for continued pre-training: the `text` column (or `column_map: {text: <column>}`), or `.txt`
    files split per line (default), per blank-line paragraph or per file (`sample_by`). Every token is trained on;
    a text longer than `max_seq_len` is cut (and counted)."""
    columns = _column_map(column_map, ("text",))
    max_seq_len = _checked_max_seq_len(None, max_seq_len, tokenizer)

    def convert(row: dict[str, Any]) -> tuple[list[int], list[int], bool]:
        text = _text(row, columns, "text")
        if hasattr(tokenizer, "encode_with_truncation"):  # mtune tokenizers: cut to max_seq_len, EOS kept
            out = tokenizer.encode_with_truncation(text, add_bos=True, add_eos=add_eos, max_seq_len=max_seq_len)
            tokens, truncated = out.tokens, out.truncated
        else:
            tokens = tokenizer.encode(text, add_bos=True, add_eos=add_eos)
            truncated = bool(max_seq_len) and len(tokens) > max_seq_len
            tokens = tokens[:max_seq_len] if truncated else tokens
        if not text.strip():  # nothing to learn but an EOS after the BOS: dropped and counted, as .txt skips them
            return tokens, [IGNORE_INDEX] * len(tokens), truncated
        return tokens, tokens[1:] + [IGNORE_INDEX], truncated

    source_rows = load_source(source, data_files, split, revision, sample_by=sample_by,
                              load_dataset_kwargs=load_dataset_kwargs)
    return build_tokenized(
        tokenizer, source_rows, convert, name="text", settings={"columns": columns, "add_eos": add_eos},
        max_seq_len=max_seq_len, packed=packed, cache=cache,
    )


def _column_map(column_map: dict[str, str] | None, names: tuple[str, ...]) -> dict[str, str]:
    column_map = dict(column_map or {})
    unknown = sorted(set(column_map) - set(names))
    if unknown:
        raise DataError(
            f"column_map: {', '.join(map(repr, unknown))} is not a column this dataset reads; its keys are the "
            f"dataset's names ({', '.join(names)}) and its values the data's columns"
        )
    return {name: str(column_map.get(name, name)) for name in names}


def _checked_max_seq_len(system_prompt: Any, max_seq_len: Any, tokenizer) -> int | None:
    """``max_seq_len``, else the tokenizer's, once ``system_prompt`` and ``max_seq_len`` are checked (DataError)."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise DataError(f"system_prompt must be text (or null), got {type(system_prompt).__name__}")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or max_seq_len < 2):
        raise DataError(f"max_seq_len={max_seq_len!r}: give a whole number of tokens, at least 2 (or null: the "
                        "tokenizer's max_seq_len)")
    return max_seq_len or getattr(tokenizer, "max_seq_len", None)


def _mapped_columns(row: dict[str, Any], columns: dict[str, str], column_map: dict | None, *names: str) -> None:
    """The optional columns among ``names`` that ``column_map`` names must be in the row (a null is read as empty):
    MissingColumn otherwise, so a misspelt name is an error, not that part of every row read as empty."""
    for name in names:
        if name in (column_map or {}) and columns[name] not in row:
            raise MissingColumn(name, columns[name])


def _text(row: dict[str, Any], columns: dict[str, str], role: str, required: bool = True) -> str:
    column = columns[role]
    value = row.get(column)
    if value is None:
        if required and column in row:  # null in JSON, an empty trailing field in CSV: the column is there
            raise RowError(f"column {column!r} is empty (null): every row needs its {role}")
        if required:
            raise MissingColumn(role, column)
        return ""
    if not isinstance(value, str):
        raise RowError(f"column {column!r} must be text, got {type(value).__name__}")
    return value


def _chat_converter(tokenizer, to_messages, train_on_input: bool, max_seq_len: int | None, to_tools=None):
    """A row's (tokens, labels, truncated): ``to_messages(row)`` gives its messages (Message objects or (role,
    content) tuples), ``to_tools(row)`` the tool definitions it offers (None: no tools)."""

    def convert(row: dict[str, Any]) -> tuple[list[int], list[int], bool]:
        tools = to_tools(row) if to_tools is not None else None
        try:
            messages = [m if isinstance(m, Message) else Message(*m) for m in to_messages(row)]
            out = tokenizer.tokenize_messages(messages, max_seq_len=max_seq_len, tools=tools)
        except ValueError as e:  # the chat format refuses this conversation (e.g. roles that do not alternate)
            raise RowError(str(e)) from None
        trained = [True] * len(out.tokens) if train_on_input else out.trained
        return out.tokens, labels_from_mask(out.tokens, trained), out.truncated

    return convert
