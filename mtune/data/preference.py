"""Preference pairs for DPO-style training: a prompt with a chosen and a rejected response.

`preference_dataset` reads the usual layouts, each through the tokenizer's own chat format:

- `prompt`, `chosen`, `rejected` strings: the prompt is the user's message, the responses the assistant's;
- `chosen`, `rejected` message lists (OpenAI `{role, content}` or ShareGPT `{from, value}`) that share every message
  but the last, an assistant reply: the shared prefix is the prompt (a `prompt` column beside them is not read);
- `prompt` a message list and `chosen` / `rejected` strings, single assistant messages or lists of one (a
  ShareGPT message dict each is LLaMA-Factory's preference layout, with the prompt in `conversations`:
  `column_map: {prompt: conversations}`).

Messages are read as chat_dataset reads them (:mod:`mtune.data.messages`): OpenAI tool calls and tool messages,
ShareGPT ``function_call`` / ``observation`` turns, with the tool definitions in a ``tools`` column that the two
conversations share (bare ShareGPT definitions wrapped as there), and a ``system`` column (LLaMA-Factory's separate
system prompt) opening a prompt that has no system message of its own. A response may be a tool call: the pair then
compares what the model calls. Tool calling goes to the chat formats that render it; the others refuse the row.

Only the final response is trained on (labelled); prompt and padding carry -100. A bad row stops the build with its
place ("pairs.jsonl line 7"): a missing field, a chosen response identical to the rejected one, an empty response,
message lists whose prefixes differ. A pair whose response was truncated away entirely, or whose two conversations
truncation leaves identical (they differed only past ``max_seq_len``), is dropped and counted.

A batch (`collate_preference`) holds the chosen rows first and the rejected rows second, so the policy sees both in
one forward; ``pair_index`` and ``pairs_of`` (the dataset's fingerprint) say which pairs they are, for a
precomputed reference.

With ``packed=True`` whole pairs share rows instead (`PackedPreferenceDataset`, `collate_packed_pairs`): each
response is a document of its row (``document_ids``, ``input_pos`` restarting at 0), so it attends only to itself,
and ``sequence_ids`` says which sequence of the batch each token belongs to, so that the loss sums each response's
log-probs in the same order as an unpacked batch (the chosen sequences, then the rejected ones).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from mtune.data.collate import collate_padded
from mtune.data.common import IGNORE_INDEX, DataError, is_main_process, log
from mtune.data.messages import conversation_messages, row_tools, with_row_system
from mtune.data.packing import pack_pairs
from mtune.data.sources import load_source
from mtune.data.tokenized import RowError, TokenizedDataset, labels_from_mask
from mtune.tokenizers.base import Message

__all__ = ["preference_dataset", "PreferenceDataset", "PackedPreferenceDataset", "collate_preference",
           "collate_packed_pairs"]

_COLUMNS = ("prompt", "chosen", "rejected", "tools", "system")


class PreferenceDataset(torch.utils.data.Dataset):
    """Map-style pairs: ``ds[i]`` is ``{"chosen": sample, "rejected": sample, "index": i}`` where a sample is
    ``{"tokens": [...], "labels": [...]}`` (labels shifted, -100 off the response). ``fingerprint`` changes with any
    token of any pair; ``collate_fn`` makes the loader's batches (:func:`collate_preference`)."""

    def __init__(self, chosen: TokenizedDataset, rejected: TokenizedDataset, pad_id: int, stats: dict[str, Any]):
        self.chosen, self.rejected, self.pad_id, self.stats = chosen, rejected, pad_id, stats
        digest = hashlib.sha256()
        for half in (chosen, rejected):
            for tensor in (*half.fields.values(), half.offsets):
                digest.update(tensor.numpy().tobytes())
        self.fingerprint = digest.hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"chosen": self.chosen[i], "rejected": self.rejected[i], "index": i}

    def collate_fn(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_preference(batch, self.pad_id, self.fingerprint)


def collate_preference(batch: list[dict[str, Any]], pad_id: int, pairs_of: str = "") -> dict[str, Any]:
    """``tokens`` / ``labels`` [2b, s] (the b chosen rows, then the b rejected rows, right-padded to one length),
    ``num_tokens`` (before padding), ``pair_index`` [b] and ``pairs_of`` (the dataset's fingerprint)."""
    out = collate_padded([p["chosen"] for p in batch] + [p["rejected"] for p in batch], pad_id, IGNORE_INDEX)
    out["pair_index"] = torch.tensor([p["index"] for p in batch], dtype=torch.long)
    out["pairs_of"] = pairs_of
    return out


class PackedPreferenceDataset(torch.utils.data.Dataset):
    """Pairs packed whole into rows of at most ``row_len`` tokens (`mtune.data.packing.pack_pairs`, dataset order;
    ``preference_dataset`` makes ``row_len`` twice its ``max_seq_len``: room for both responses at full length, so
    packing cuts nothing the unpacked batch keeps). ``ds[i]`` is a row: ``tokens``, ``labels``, ``input_pos``,
    ``document_ids`` (pair j's chosen conversation is document 2j, its rejected one 2j + 1) and ``pairs`` (the
    indices of its pairs in ``self.pairs``, the unpacked :class:`PreferenceDataset`, whose ``fingerprint`` it
    shares: a precomputed reference is the same per pair packed or not)."""

    packed = True

    def __init__(self, pairs: PreferenceDataset, row_len: int):
        self.pairs, self.row_len, self.pad_id, self.fingerprint = pairs, row_len, pairs.pad_id, pairs.fingerprint
        lengths = zip(torch.diff(pairs.chosen.offsets).tolist(), torch.diff(pairs.rejected.offsets).tolist())
        self.rows = pack_pairs(list(lengths), row_len)
        real = int(pairs.chosen.offsets[-1] + pairs.rejected.offsets[-1])
        self.stats = {**pairs.stats, "packs": len(self.rows), "padding": len(self.rows) * row_len - real}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row: dict[str, Any] = {"tokens": [], "labels": [], "input_pos": [], "document_ids": []}
        for j, index in enumerate(self.rows[i]):
            for side, sample in enumerate((self.pairs.chosen[index], self.pairs.rejected[index])):
                n = len(sample["tokens"])
                row["tokens"] += sample["tokens"]
                row["labels"] += sample["labels"]
                row["input_pos"] += range(n)
                row["document_ids"] += [2 * j + side] * n
        row["pairs"] = self.rows[i]
        return row

    def collate_fn(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_packed_pairs(batch, self.pad_id, self.fingerprint)


def collate_packed_pairs(batch: list[dict[str, Any]], pad_id: int, pairs_of: str = "") -> dict[str, Any]:
    """Packed rows of pairs to a batch: ``tokens``, ``labels``, ``input_pos``, ``document_ids`` [r, s] right-padded
    to the longest row (the padding a document of its own), ``sequence_ids`` [r, s] (for the n pairs of the batch in
    row order: pair k's chosen tokens k, its rejected tokens n + k, padding -1), ``pair_index`` [n], ``pairs_of`` and
    ``num_tokens`` (before padding)."""
    fields = ("tokens", "labels", "input_pos", "document_ids")
    out = collate_padded([{k: row[k] for k in fields} for row in batch], pad_id, IGNORE_INDEX)
    counts = [len(row["pairs"]) for row in batch]
    n = sum(counts)
    sequence_ids = torch.full_like(out["document_ids"], -1)
    first = 0
    for r, k in enumerate(counts):
        doc = out["document_ids"][r]
        sequence_ids[r] = torch.where(doc < 2 * k, first + doc // 2 + n * (doc % 2), -1)
        first += k
    out["sequence_ids"] = sequence_ids
    out["pair_index"] = torch.tensor([i for row in batch for i in row["pairs"]], dtype=torch.long)
    out["pairs_of"] = pairs_of
    return out


def preference_dataset(
    tokenizer,
    source: str,
    *,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    max_seq_len: int | None = None,
    data_files: Any = None,
    split: str = "train",
    revision: str | None = None,
    load_dataset_kwargs: Mapping[str, Any] | None = None,
    packed: bool = False,
) -> PreferenceDataset | PackedPreferenceDataset:
    """Preference pairs from JSON / JSONL / Parquet / CSV files or the hub (see the module docstring for the
    layouts). ``column_map``: ``{prompt|chosen|rejected|tools|system: the data's column}``; ``system_prompt``: a system
    message before every prompt, instead of the data's; ``max_seq_len``: truncation of each response's conversation
    (default: the tokenizer's); ``packed``: whole pairs packed into rows of ``2 x max_seq_len`` tokens
    (:class:`PackedPreferenceDataset`), and ``batch_size`` then counts rows."""
    unknown = sorted(set(column_map or {}) - set(_COLUMNS))
    if unknown:
        raise DataError(f"column_map: {', '.join(map(repr, unknown))} is not a column preference_dataset reads; its "
                        f"keys are {', '.join(_COLUMNS)}")
    columns = {name: str((column_map or {}).get(name, name)) for name in _COLUMNS}
    # optional columns column_map names must be there: a misspelt name would drop the system prompt or tools silently
    mapped_optional = [columns[name] for name in ("tools", "system") if name in (column_map or {})]
    max_seq_len = max_seq_len or getattr(tokenizer, "max_seq_len", None)
    rows = load_source(source, data_files, split, revision, load_dataset_kwargs=load_dataset_kwargs)
    halves: dict[str, list] = {"chosen": [], "rejected": []}
    n_rows = truncated = dropped = 0
    for row in rows.read():
        n_rows += 1
        try:
            absent = [column for column in mapped_optional if column not in row.data]
            if absent:
                raise RowError(f"no column {absent[0]!r} (column_map names it); the row has {', '.join(row.data)}")
            prefix, responses, tools = _pair(row.data, columns, system_prompt)
            samples = {side: _tokenize(tokenizer, prefix, responses[side], max_seq_len, tools) for side in halves}
        except RowError as e:
            raise DataError(f"{row.where}: {e}") from None
        truncated += any(s[2] for s in samples.values())
        if any(all(label == IGNORE_INDEX for label in s[1]) for s in samples.values()) or (
                samples["chosen"][0] == samples["rejected"][0]):
            dropped += 1  # a response truncated away, or all that told the two apart: nothing to compare
            continue
        for side, sample in samples.items():
            halves[side].append(sample)
    if n_rows == 0:
        raise DataError(f"{rows.description}: the dataset is empty")
    if not halves["chosen"]:
        raise DataError(f"{rows.description}: every one of {n_rows} pairs lost its response to truncation: raise "
                        "max_seq_len")
    stats = {"rows": n_rows, "pairs": len(halves["chosen"]), "truncated": truncated, "dropped_truncated": dropped}
    dataset = PreferenceDataset(*(_flat(halves[side], tokenizer.pad_id) for side in ("chosen", "rejected")),
                                pad_id=tokenizer.pad_id, stats=stats)
    packs = ""
    if packed:
        if not max_seq_len:
            raise DataError(f"{rows.description}: packed=true needs max_seq_len (on the dataset or the tokenizer)")
        dataset = PackedPreferenceDataset(dataset, 2 * max_seq_len)
        packs = (f"; packed into {dataset.stats['packs']} rows of up to {dataset.row_len} tokens "
                 f"({dataset.stats['padding']} tokens short of full)")
    if is_main_process():
        log.info("preference pairs (%s): %d pairs%s%s%s", rows.description, stats["pairs"],
                 f"; {truncated} truncated to max_seq_len={max_seq_len}" if truncated else "",
                 f"; {dropped} dropped with a response (or all that differs) truncated away" if dropped else "", packs)
    return dataset


def _pair(row: dict[str, Any], columns: dict[str, str], system_prompt: str | None):
    """``(prompt messages, {"chosen": reply, "rejected": reply}, tools)`` of one row, or RowError."""
    for name in ("chosen", "rejected"):
        if row.get(columns[name]) is None:
            raise RowError(f"missing field {columns[name]!r}")
    prompt, chosen, rejected = row.get(columns["prompt"]), row[columns["chosen"]], row[columns["rejected"]]
    if isinstance(chosen, list) and isinstance(rejected, list) and (prompt is None or max(len(chosen),
                                                                                         len(rejected)) > 1):
        # whole conversations (a prompt column beside them, as in UltraFeedback, repeats their first message)
        conversation = chosen
        chosen = conversation_messages(chosen, columns["chosen"]) if chosen else []
        rejected = conversation_messages(rejected, columns["rejected"]) if rejected else []
        if not chosen or not rejected or chosen[:-1] != rejected[:-1]:
            raise RowError("chosen and rejected must be message lists that share every message but the last")
        prefix, replies = chosen[:-1], {"chosen": chosen[-1], "rejected": rejected[-1]}
    else:
        if prompt is None:
            raise RowError(f"missing field {columns['prompt']!r} (or give chosen and rejected as message lists)")
        conversation = prompt
        if isinstance(prompt, str):
            prefix = [Message("user", prompt)]
        elif isinstance(prompt, list):
            prefix = conversation_messages(prompt, columns["prompt"])
        else:
            raise RowError(f"field {columns['prompt']!r} must be text or a message list")
        replies = {side: _reply(value, columns[side]) for side, value in (("chosen", chosen), ("rejected", rejected))}
    for side, reply in replies.items():
        if reply.role != "assistant":
            raise RowError(f"the {side} response must be an assistant message, got role {reply.role!r}")
        if not reply.content.strip() and not reply.tool_calls:
            raise RowError(f"the {side} response is empty")
    if replies["chosen"] == replies["rejected"]:
        raise RowError("chosen and rejected are identical")
    if system_prompt:
        prefix = [Message("system", system_prompt)] + [m for m in prefix if m.role != "system"]
    else:
        prefix = with_row_system(prefix, row.get(columns["system"]), columns["system"])
    return prefix, replies, row_tools(row.get(columns["tools"]), columns["tools"], conversation)


def _reply(value: Any, column: str) -> Message:
    if isinstance(value, str):
        return Message("assistant", value)
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and len(value) == 1:
        return conversation_messages(value, column)[0]
    raise RowError(f"field {column!r} must be text, one assistant message or a list of one")


def _tokenize(tokenizer, prefix: list[Message], reply: Message, max_seq_len: int | None, tools: Any = None):
    """``(tokens, labels, truncated)``: the conversation, labelled on the final reply only."""
    messages = [*prefix, reply]
    try:
        out = tokenizer.tokenize_messages(messages, max_seq_len=max_seq_len, tools=tools)
        prompt = tokenizer.tokenize_messages(messages[:-1], add_generation_prompt=True, tools=tools).tokens
    except ValueError as e:  # the chat format refuses the conversation (roles that do not alternate)
        raise RowError(str(e)) from None
    if out.tokens[:len(prompt)] == prompt:
        start = len(prompt)
    else:  # the prompt renders otherwise without the reply (gpt-oss keeps a call's reasoning when no answer follows):
        # the reply is the conversation's last run of trained tokens
        start = len(out.trained)
        while start > 0 and not out.trained[start - 1]:
            start -= 1
        while start > 0 and out.trained[start - 1]:
            start -= 1
    trained = [m and i >= start for i, m in enumerate(out.trained)]
    return out.tokens, labels_from_mask(out.tokens, trained), out.truncated


def _flat(samples: list[tuple[list[int], list[int], bool]], pad_id: int) -> TokenizedDataset:
    lengths = torch.tensor([0] + [len(s[0]) for s in samples], dtype=torch.int64)
    fields = {name: torch.tensor([t for s in samples for t in s[k]], dtype=torch.int32)
              for k, name in ((0, "tokens"), (1, "labels"))}
    return TokenizedDataset(fields, torch.cumsum(lengths, 0), pad_id, {})
